"""The integration with opacus-spectral (the ``[dp]`` extra): LoRA roles for denoisers, the alternation controller
of its ``DPTrainer`` (``plugin.py``: the entry point)."""
