"""The entry-point module: tells opacus-spectral which denoisers this distribution provides."""

from opacus_spectral import hookimpl

from .svht import SVHTDenoiser


@hookimpl
def opacus_spectral_denoisers():
    return {"svht": SVHTDenoiser}
