"""Register ``LALORA`` with PEFT (runs on ``import peft_lalora``; PEFT facts in ``docs/upstream.md`` §2.1).

``peft.utils.register_peft_method`` only accepts members of PEFT's closed ``PeftType`` enum, so we write
into the three mappings PEFT 0.21 looks every tuner up in (plain dict lookups by a key equal to the string
``"LALORA"``): ``PEFT_TYPE_TO_CONFIG_MAPPING`` (config class for ``PeftConfig.from_pretrained``),
``PEFT_TYPE_TO_TUNER_MAPPING`` (tuner for ``get_peft_model``, ``PeftModel``, ``get/set_peft_model_state_dict``)
and ``PEFT_TYPE_TO_PREFIX_MAPPING`` (parameter prefix for trainable/missing-key handling, hotswap).
Not registered: ``PEFT_TYPE_TO_MIXED_MODEL_MAPPING`` — PEFT's mixed model accepts a fixed list of
built-in types, so a LALoRA adapter cannot join a ``PeftMixedModel``.
"""

from __future__ import annotations

from typing import Any

from .config import LALoraConfig, LALoraPeftType
from .model import LALoraModel

PEFT_TYPE = LALoraPeftType.LALORA
PREFIX = LALoraModel.prefix


def _entries() -> list[tuple[dict[Any, Any], str, object]]:
    from peft import mapping

    return [
        (mapping.PEFT_TYPE_TO_CONFIG_MAPPING, "PEFT_TYPE_TO_CONFIG_MAPPING", LALoraConfig),
        (mapping.PEFT_TYPE_TO_TUNER_MAPPING, "PEFT_TYPE_TO_TUNER_MAPPING", LALoraModel),
        (mapping.PEFT_TYPE_TO_PREFIX_MAPPING, "PEFT_TYPE_TO_PREFIX_MAPPING", PREFIX),
    ]


def _is_ours(existing: object, ours: object) -> bool:
    """Same object, or the same class re-created by ``importlib.reload`` of this package."""
    if existing is ours or (isinstance(ours, str) and existing == ours):
        return True
    return (
        isinstance(existing, type)
        and isinstance(ours, type)
        and (existing.__module__, existing.__qualname__) == (ours.__module__, ours.__qualname__)
    )


def register() -> None:
    """Make PEFT know ``LALORA``. Idempotent.

    Raises:
        RuntimeError: another package already registered something different under ``"LALORA"`` (nothing
            is changed then).
    """
    entries = _entries()
    for table, table_name, ours in entries:
        if PEFT_TYPE in table and not _is_ours(table[PEFT_TYPE], ours):
            raise RuntimeError(
                f"peft.mapping.{table_name}['LALORA'] is already set to {table[PEFT_TYPE]!r}, not peft_lalora's "
                f"{ours!r}; refusing to overwrite another package's registration."
            )
    for table, _, ours in entries:
        # Drop a possibly equal key of another type first so the key object is our enum member.
        table.pop(PEFT_TYPE, None)
        table[PEFT_TYPE] = ours


def is_registered() -> bool:
    """True when every PEFT mapping points ``"LALORA"`` at this package's classes."""
    return all(PEFT_TYPE in table and _is_ours(table[PEFT_TYPE], ours) for table, _, ours in _entries())
