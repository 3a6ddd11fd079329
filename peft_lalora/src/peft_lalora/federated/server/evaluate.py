"""Accuracy and loss of a classifier on held-out data: the server's evaluation of a global adapter.

:func:`classification_metrics` is the one evaluation loop of the project (the ``dp-bench`` harness uses it
for its centralized beds too); :class:`Evaluator` loads a global adapter state into a model built once and
evaluates it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..client.dp_client import adapter_state, load_adapter_state, trainable_parameters

__all__ = ["Evaluator", "classification_metrics"]


@torch.no_grad()
def classification_metrics(
    model: nn.Module,
    batches: Iterable[Sequence[torch.Tensor]],
    *,
    input_names: Sequence[str] | None = None,
    device: torch.device | str | None = None,
) -> dict[str, float]:
    """``{"accuracy", "loss", "n"}`` of ``model`` (in eval mode; its mode is restored) over ``batches`` of
    ``(*inputs, labels)``. Inputs go by keyword when ``input_names`` is given, else positionally; the output
    may be logits or a Hugging Face output with ``.logits``. The loss is the mean cross-entropy (float64 sum)."""
    was_training = model.training
    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=device)
    loss = torch.zeros((), dtype=torch.float64, device=device)
    n = 0
    try:
        for batch in batches:
            if device is not None:
                batch = [t.to(device) for t in batch]
            *inputs, labels = batch
            out = model(**dict(zip(input_names, inputs, strict=True))) if input_names else model(*inputs)
            logits = getattr(out, "logits", out)
            correct += (logits.argmax(-1) == labels).sum().to(correct.device)
            loss += nn.functional.cross_entropy(logits.double(), labels, reduction="sum").to(loss.device)
            n += labels.shape[0]
    finally:
        model.train(was_training)
    if n == 0:
        raise ValueError("empty evaluation set")
    return {"accuracy": float(correct) / n, "loss": float(loss) / n, "n": n}


class Evaluator:
    """Server-side accuracy of a global adapter state on a held-out set (one model, built once)."""

    def __init__(
        self,
        model: nn.Module,
        peft_config: Any,
        test_data: torch.utils.data.Dataset,
        *,
        batch_size: int = 256,
        device: str = "cpu",
        input_names: Sequence[str] | None = None,
    ) -> None:
        from peft import PeftModel, get_peft_model

        #: keyword names of the batch's input tensors (default: input_ids, attention_mask[, token_type_ids])
        self.input_names = None if input_names is None else tuple(input_names)
        self.model = model if isinstance(model, PeftModel) else get_peft_model(model, peft_config)
        self.device = torch.device(device)
        self.model.to(self.device).eval()
        self.params = trainable_parameters(self.model)
        self.loader = torch.utils.data.DataLoader(test_data, batch_size=batch_size, shuffle=False)

    def initial_state(self) -> dict[str, torch.Tensor]:
        """The adapter state of the freshly built model (the federation's starting point)."""
        return adapter_state(self.params)

    def __call__(self, state: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """``{"accuracy", "loss"}`` of the model with ``state`` loaded (labels are the last batch tensor)."""
        load_adapter_state(self.params, state)
        names = self.input_names
        if names is None:
            n_inputs = len(next(iter(self.loader))) - 1
            names = ("input_ids", "attention_mask", "token_type_ids")[:n_inputs]
        m = classification_metrics(self.model, self.loader, input_names=names, device=self.device)
        return {"accuracy": m["accuracy"], "loss": m["loss"]}
