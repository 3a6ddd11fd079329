"""One-run privacy auditing: a lower bound on ε from a single training run, to compare with the accountant's ε
(``docs/audit.md``, ``docs/math.md`` §5).

* :func:`one_run_epsilon_lower_bound`, :func:`one_run_p_value` — the (ε, δ) bound of Steinke, Nasr & Jagielski
  (NeurIPS 2023, arXiv 2305.08846; pure statistics, scipy);
* :func:`one_run_gdp_lower_bound`, :func:`one_run_fdp_epsilon_lower_bound`, :func:`one_run_fdp_mass` — the f-DP
  bound of Mahloujifar, Melis & Chaudhuri (ICML 2025, arXiv 2410.22235) against μ-GDP: tighter for Gaussian noise;
* :func:`audit_scores`, :class:`AuditResult` — from per-canary scores to a bound (the auditor's guesses);
* :class:`GradientCanaries` — white-box Dirac gradient canaries in an Opacus optimizer, scored on the released
  (noisy, denoised) gradients; cyclic on a BandMF run (:mod:`.cyclic`);
* :class:`InputCanaries` — black-box mislabeled examples, scored by their loss on the final model;
* :func:`canary_epsilon`, :func:`gaussian_dp_epsilon` — the ε a correct engine claims for one canary.
"""

from .bound import one_run_epsilon_lower_bound, one_run_p_value
from .claims import canary_epsilon, gaussian_dp_delta, gaussian_dp_epsilon
from .fdp import one_run_fdp_epsilon_lower_bound, one_run_fdp_mass, one_run_gdp_lower_bound
from .gradient_canaries import GradientCanaries
from .guesses import AuditResult, audit_scores, default_guesses
from .input_canaries import InputCanaries

__all__ = [
    "AuditResult",
    "GradientCanaries",
    "InputCanaries",
    "audit_scores",
    "canary_epsilon",
    "default_guesses",
    "gaussian_dp_delta",
    "gaussian_dp_epsilon",
    "one_run_epsilon_lower_bound",
    "one_run_fdp_epsilon_lower_bound",
    "one_run_fdp_mass",
    "one_run_gdp_lower_bound",
    "one_run_p_value",
]
