"""DOPPLER temporal low-pass filtering for opacus-spectral."""

from .doppler import PRESETS, DopplerDenoiser, step_response

__all__ = ["PRESETS", "DopplerDenoiser", "step_response"]
