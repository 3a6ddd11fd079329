"""What a DP run spends: σ calibration, ε from a history (always an upper bound, or an error),
the sampling's accounting, the privacy record a model carries, checkpoint checks."""

from .calibration import epsilon_from_history, noise_multiplier_for
from .record import (
    PrivacyRecord,
    PrivacyRun,
    load_privacy_record,
    noise_multiplier_after,
    privacy_record_of,
    read_privacy_record,
    save_privacy_record,
    write_privacy_record,
)

__all__ = [
    "PrivacyRecord",
    "PrivacyRun",
    "epsilon_from_history",
    "load_privacy_record",
    "noise_multiplier_after",
    "noise_multiplier_for",
    "privacy_record_of",
    "read_privacy_record",
    "save_privacy_record",
    "write_privacy_record",
]
