"""The integration with opacus-spectral (the ``[dp]`` extra): LoRA roles for denoisers."""
