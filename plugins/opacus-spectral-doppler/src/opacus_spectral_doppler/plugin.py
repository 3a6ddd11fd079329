"""The entry-point module."""

from opacus_spectral import hookimpl

from .doppler import DopplerDenoiser


@hookimpl
def opacus_spectral_denoisers():
    return {"doppler": DopplerDenoiser}
