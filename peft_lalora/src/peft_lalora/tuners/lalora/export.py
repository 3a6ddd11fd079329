"""Export a LALoRA adapter as a plain LoRA adapter (for serving stacks that only know LoRA).

A LALoRA adapter *is* a LoRA adapter: same layers, same ``lora_A`` / ``lora_B`` tensors, same forward
``h = W x + s·B A x``. Only ``adapter_config.json`` differs (``peft_type="LALORA"`` plus the two schedule
fields). The export therefore copies the weight file unchanged and rewrites the config as a
``LoraConfig`` — an exact relabel (identical logits), unlike PEFT's ``save_as_lora`` / ``convert_to_lora``,
which re-factor ``ΔW`` by a truncated SVD (approximate, scaling folded into the weights, more work;
``docs/upstream.md`` §2.4). The privacy record travels with it: the model's (or the folder's ``privacy_record.json``)
is written beside the exported adapter, so a later run composes with it instead of restarting ε.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from peft import LoraConfig, PeftModel

from .config import LALoraConfig

_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_OWN_FIELDS = {f.name for f in dataclasses.fields(LALoraConfig)} - {f.name for f in dataclasses.fields(LoraConfig)}


def to_lora_config(config: LALoraConfig | LoraConfig | dict[str, Any]) -> LoraConfig:
    """The ``LoraConfig`` with every LoRA field of ``config`` (a config object or its JSON dict), without
    the LALoRA schedule fields and with ``peft_type="LORA"``."""
    data = dict(config) if isinstance(config, dict) else config.to_dict()
    lora_fields = {f.name for f in dataclasses.fields(LoraConfig) if f.init}
    kwargs = {k: v for k, v in data.items() if k in lora_fields and k not in _OWN_FIELDS and k != "peft_type"}
    unknown = sorted(set(data) - lora_fields - _OWN_FIELDS - {"peft_type"})
    if unknown:
        raise ValueError(f"Cannot express config fields {unknown} as a LoraConfig (newer PEFT version?).")
    return LoraConfig(**kwargs)


def export_as_lora(
    source: PeftModel | str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    adapter_name: str = "default",
    delta: float | None = None,
) -> Path:
    """Write ``source``'s adapter to ``output_dir`` as a plain LoRA adapter that PEFT loads without
    ``peft_lalora`` (``PeftModel.from_pretrained(base, output_dir)`` gives identical logits).

    Args:
        source: a ``PeftModel`` holding a LALoRA (or LoRA) adapter, or a directory written by its
            ``save_pretrained`` (the one containing ``adapter_config.json``).
        output_dir: target directory (created; files of the same name are overwritten).
        adapter_name: which adapter of a ``PeftModel`` to export.
        delta: the δ of a DP run the model's privacy record holds without one (a hand-written loop's), for the
            record written beside the export.

    Returns:
        ``Path(output_dir)``.

    Raises:
        ValueError: unknown adapter, a config that is not LALoRA/LoRA, or no weight file in ``source``.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(source, PeftModel):
        if adapter_name not in source.peft_config:
            raise ValueError(f"Adapter {adapter_name!r} not found; adapters: {sorted(source.peft_config)}.")
        config = source.peft_config[adapter_name]
        _check_lora_like(config.to_dict())
        with tempfile.TemporaryDirectory() as tmp:
            source.save_pretrained(tmp, selected_adapters=[adapter_name])
            saved = Path(tmp) if adapter_name == "default" else Path(tmp) / adapter_name
            _copy_weights(saved, out)
        to_lora_config(config).save_pretrained(str(out))
        _carry_record(source, out, delta)
        return out
    src = Path(source)
    config_path = src / "adapter_config.json"
    if not config_path.is_file():
        raise ValueError(f"{src} has no adapter_config.json.")
    data = json.loads(config_path.read_text())
    _check_lora_like(data)
    if src.resolve() != out.resolve():
        _copy_weights(src, out)
        _carry_record(src, out, delta)
    to_lora_config(data).save_pretrained(str(out))
    return out


def _carry_record(source: PeftModel | Path, out: Path, delta: float | None) -> None:
    """The privacy record of ``source`` (a model's, or the folder's file) beside the export; none without the [dp]
    extra (no DP run could have made one). A model whose record cannot be written (no δ yet) is refused: an export
    that silently dropped it would let the next run restart ε."""
    try:
        from opacus_spectral.accounting.record import RECORD_FILE, privacy_record_of, save_privacy_record
    except ImportError:  # pragma: no cover - peft_lalora without opacus_spectral
        return
    if isinstance(source, Path):
        if (source / RECORD_FILE).is_file():
            shutil.copyfile(source / RECORD_FILE, out / RECORD_FILE)
    elif privacy_record_of(source) is not None:
        try:
            save_privacy_record(source, out, delta=delta)
        except ValueError as err:
            if delta is None:
                raise ValueError(
                    "export_as_lora: the model carries a DP privacy record without a δ (a hand-written loop's): pass "
                    "export_as_lora(..., delta=...), the δ at which you report its ε, so that the record travels "
                    "with the export"
                ) from err
            raise


def _check_lora_like(data: dict[str, Any]) -> None:
    peft_type = str(getattr(data.get("peft_type"), "value", data.get("peft_type")))
    if peft_type not in ("LALORA", "LORA"):
        raise ValueError(f"export_as_lora exports LALoRA/LoRA adapters only, got peft_type={peft_type!r}.")


def _copy_weights(src: Path, out: Path) -> None:
    for name in _WEIGHT_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
            return
    raise ValueError(f"No adapter weight file ({' or '.join(_WEIGHT_FILES)}) in {src}.")
