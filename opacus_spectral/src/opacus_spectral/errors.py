"""Every exception and warning opacus-spectral raises or emits, in one place (``from opacus_spectral.errors import
...``). Each says what went wrong and what to do; the docs page that explains it is named in its docstring.

Errors: :class:`DenoiserError`, :class:`NonFiniteGradientError` (the post-noise pipeline), :class:`DenoiserBuildError`
(a denoiser spec that cannot be built), :class:`DoctorError` (the doctor, ``mode="raise"``),
:class:`BatchDependenceError` (a record's gradient depends on the other records of its batch),
:class:`NoiseCertificateError` (a step released other noise than it was charged for). Warnings: privacy
(:class:`NonPrivateWarning`, :class:`ReproducibleNoiseWarning`, :class:`ApproximateEpsilonWarning`,
:class:`ShuffledSamplingWarning`, :class:`IgnoredSamplerWarning`, :class:`ComposedPrivacyWarning`), the doctor
(:class:`DoctorWarning`, :class:`BatchCheckWarning`) and advice (:class:`DenoiserAdviceWarning`,
:class:`LargeNoiseWarning`).
"""

from __future__ import annotations

__all__ = [
    "NonPrivateWarning",
    "ReproducibleNoiseWarning",
    "DenoiserError",
    "NonFiniteGradientError",
    "DenoiserAdviceWarning",
    "DenoiserBuildError",
    "DoctorWarning",
    "DoctorError",
    "BatchCheckWarning",
    "BatchDependenceError",
    "ApproximateEpsilonWarning",
    "ShuffledSamplingWarning",
    "IgnoredSamplerWarning",
    "ComposedPrivacyWarning",
    "NoiseCertificateError",
    "LargeNoiseWarning",
    "PastHorizonWarning",
]


class NonPrivateWarning(RuntimeWarning):
    """``noise_multiplier=0`` without ``allow_non_private=True``: clipping only, no differential privacy."""


class ReproducibleNoiseWarning(UserWarning):
    """Noise drawn from a seed the user chose: reproducible, and not private against whoever knows the seed."""


class DenoiserError(RuntimeError):
    """A denoiser raised or returned an invalid gradient."""


class NonFiniteGradientError(RuntimeError):
    """The noisy gradient of a step holds NaN/Inf (``on_nonfinite_grad="raise"``)."""


class DenoiserAdviceWarning(UserWarning):
    """A denoiser/optimizer combination measured to hurt accuracy (``docs/denoisers.md``)."""


class DenoiserBuildError(ValueError):
    """Building a named denoiser of ``post_hooks`` failed; names the denoiser, plugin and distribution.

    The factory's own exception is the ``__cause__``. A ``ValueError``: the ``post_hooks`` item cannot be built.
    """


class DoctorWarning(RuntimeWarning):
    """A doctor finding (``mode="warn"``)."""


class DoctorError(RuntimeError):
    """A doctor finding (``mode="raise"``)."""


class BatchCheckWarning(RuntimeWarning):
    """The batch-independence check could not run on this set-up (it says why); nothing was verified."""


class BatchDependenceError(RuntimeError):
    """A record's output or gradient changed when another record left its batch: the clipped sum's sensitivity is no
    longer ``max_grad_norm`` and the privacy guarantee is void."""


class ApproximateEpsilonWarning(UserWarning):
    """An ε from ``accountant="gdp"``: an approximation, not an upper bound (use ``"prv"`` or ``"rdp"``)."""


class ShuffledSamplingWarning(UserWarning):
    """``poisson_sampling=False``: ε is the un-amplified bound (one Gaussian mechanism per pass over the data)."""


class IgnoredSamplerWarning(UserWarning):
    """``poisson_sampling=True`` with a loader whose sampler is not uniform: Opacus replaces it (Opacus #813)."""


class LargeNoiseWarning(UserWarning):
    """A calibrated noise multiplier above ``SIGMA_LARGE`` (100, ``docs/engine.md``, "Accounting"): the noise then
    swamps the gradient of any batch of fewer than σ records."""


class PastHorizonWarning(UserWarning):
    """A BandMF run goes past the steps its coefficients were optimized for (``docs/mechanisms.md``): its noise and ε
    stay exact, the coefficients are only optimal for the shorter run."""


class ComposedPrivacyWarning(UserWarning):
    """A new engine or ``DPTrainer`` composes with the privacy record the model carries (ε continues)."""


class NoiseCertificateError(RuntimeError):
    """A step released less (or other) noise than the engine charged for it (:mod:`.mechanisms.certificate`): the step
    is stopped before its update."""
