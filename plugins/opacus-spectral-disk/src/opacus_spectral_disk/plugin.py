"""The entry-point module."""

from opacus_spectral import hookimpl

from .disk import DiskDenoiser


@hookimpl
def opacus_spectral_denoisers():
    return {"disk": DiskDenoiser}
