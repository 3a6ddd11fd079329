"""``LALoraModel``: the PEFT tuner behind ``LALoraConfig``.

The forward pass, layer injection, merging and state-dict layout are exactly LoRA's (``lora_A`` /
``lora_B`` under the prefix ``"lora_"``), so a saved LALoRA adapter differs from a LoRA one only in its
``adapter_config.json``. The alternation schedule lives in :class:`peft_lalora.AlternationController`.
"""

from __future__ import annotations

from peft.tuners.lora import LoraModel


class LALoraModel(LoraModel):
    """LoRA tuner registered under the PEFT type ``"LALORA"`` (see :mod:`peft_lalora.tuners.lalora.registration`).

    The prefix stays ``"lora_"``: PEFT tests ``prefix in name`` to place new adapters on the right
    device and to report missing keys (``docs/upstream.md`` §2.3), and the shared prefix keeps the weights
    loadable as plain LoRA.
    """

    prefix: str = "lora_"
