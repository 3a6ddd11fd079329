"""Black-box input canaries: mislabeled examples, scored by their loss on the final model (``docs/math.md`` §5.6).

Each canary is a real input with a wrong label (drawn uniformly among the other classes), included in the
training set with probability ½. Included canaries are ordinary training examples — sampled, clipped and
noised like every other — so the claim they are audited against is the engine's own accountant ε.
The auditor sees only the final model: the score of a canary is minus its cross-entropy loss (a memorized
wrong label has a low loss).

The training loop is the caller's: add :meth:`InputCanaries.dataset` (the included canaries) to the training
data before ``make_private``, train, then call :meth:`InputCanaries.audit` on the final model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .guesses import AuditResult, audit_scores

__all__ = ["InputCanaries"]


@dataclass
class InputCanaries:
    """m mislabeled examples and their secret membership coins."""

    inputs: torch.Tensor  #: (m, ...) canary inputs
    labels: torch.Tensor  #: (m,) the wrong labels they are trained with
    included: torch.Tensor  #: (m,) bool, the coins

    def __post_init__(self) -> None:
        m = self.inputs.shape[0]
        if self.labels.shape != (m,) or self.included.shape != (m,) or self.included.dtype != torch.bool:
            raise ValueError("inputs (m, ...), labels (m,) and included (m,) bool must agree")

    @classmethod
    def mislabeled(
        cls, inputs: torch.Tensor, labels: torch.Tensor, num_classes: int, *, seed: int = 0
    ) -> InputCanaries:
        """Canaries from held-out examples ``(inputs, labels)``: each label moved to a uniformly drawn other
        class, each canary included with probability ½ (both from ``seed``)."""
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        rng = np.random.default_rng(seed)
        m = int(inputs.shape[0])
        shift = torch.from_numpy(rng.integers(1, num_classes, size=m))
        wrong = (labels.to(torch.int64) + shift) % num_classes
        return cls(inputs, wrong, torch.from_numpy(rng.random(m) < 0.5))

    def dataset(self) -> torch.utils.data.TensorDataset:
        """The included canaries, to be added to the training set (e.g. with ``ConcatDataset``)."""
        return torch.utils.data.TensorDataset(self.inputs[self.included], self.labels[self.included])

    @torch.no_grad()
    def losses(self, model: nn.Module, batch: int = 512) -> torch.Tensor:
        """Per-canary cross-entropy of ``model`` (evaluated in eval mode; the mode is restored)."""
        was = model.training
        model.eval()
        try:
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
            out = []
            for i in range(0, self.inputs.shape[0], batch):
                logits = model(self.inputs[i : i + batch].to(device))
                logits = getattr(logits, "logits", logits)
                y = self.labels[i : i + batch].to(device)
                out.append(nn.functional.cross_entropy(logits.float(), y, reduction="none").double().cpu())
            return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)
        finally:
            model.train(was)

    def audit(
        self,
        model: nn.Module,
        *,
        delta: float = 0.0,
        confidence: float = 0.95,
        guesses: Sequence[tuple[int, int]] | None = None,
    ) -> AuditResult:
        """The one-run lower bound from the final model (score = −loss; compare with the engine's ε)."""
        return audit_scores(-self.losses(model), self.included, delta=delta, confidence=confidence, guesses=guesses)
