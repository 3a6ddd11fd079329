"""What a ``DPTrainer`` training log record may carry (``docs/trainer.md``, "Not private, so not logged").

An allowlist: a key reaches ``log_history``, ``trainer_state.json``, callbacks' ``on_log`` and ``report_to``
integrations only if it is public (a function of the step count and the configuration: ``epoch``,
``learning_rate``, ``step``) or noised (``epsilon``, ``delta``: the accountant's). Everything else is dropped unless
``release_nonprivate_stats=True``: the loss, the token and FLOP counts (which count the Poisson-sampled records) and
the end-of-training summary (``train_runtime`` and the speeds derived from it: the time scales with the number of
sampled records). Evaluation records are not filtered: they are computed on the evaluation set you chose. The
progress bar, which would print each step's time, is replaced by one without timing
(:mod:`~opacus_spectral.hf.progress`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["NONPRIVATE_LOG_KEYS", "PUBLIC_LOG_KEYS", "drop_unlisted"]

PUBLIC_LOG_KEYS = frozenset({"epoch", "learning_rate", "step", "epsilon", "delta"})
#: what the Trainer computes from the private training data without noise
NONPRIVATE_LOG_KEYS = (
    "loss",
    "train_loss",
    "grad_norm",
    "num_input_tokens_seen",
    "total_flos",
    "train_runtime",
    "train_samples_per_second",
    "train_steps_per_second",
    "train_tokens_per_second",
)
#: the Trainer's own statistics with these prefixes are dropped without a warning (summary, memory tracker)
_TRAINER_PREFIXES = ("train_", "init_mem_")


def drop_unlisted(logs: dict[str, Any]) -> list[str]:
    """Remove (in place) every key of ``logs`` not in :data:`PUBLIC_LOG_KEYS`; return the removed keys that are
    not the Trainer's own statistics (a user's or an integration's, worth a warning)."""
    dropped = [k for k in logs if k not in PUBLIC_LOG_KEYS]
    for k in dropped:
        del logs[k]
    return [k for k in dropped if k not in NONPRIVATE_LOG_KEYS and not k.startswith(_TRAINER_PREFIXES)]
