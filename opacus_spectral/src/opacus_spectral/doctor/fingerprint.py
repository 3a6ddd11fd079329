"""A cheap fingerprint of the optimizer's parameters: did they change between two DP steps?

The fingerprint is the float32 2-norm of every parameter tensor, from fused ``torch._foreach_norm`` kernels on the
parameters' devices (one read of the parameters, no copy, no host-device sync). The doctor takes it at the first
training-mode forward pass after a DP step (loading weights before that pass is fine) and again at the next DP
step, before the optimizer updates; a difference means something other than the DP step moved a parameter in
between (a second optimizer stepping on the clean gradient). On CPU the answer is read at once; on an accelerator
it is copied to the host without waiting and read at a later step, once the device has produced it
(:meth:`ParameterFingerprint.ready`). A norm misses a change that keeps it (a sign flip, a permutation) or one too
small for float32 to register.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..step.validation import tensor_norms


def _by_device(norms: list[torch.Tensor]) -> dict[torch.device, tuple[list[int], torch.Tensor]]:
    groups: dict[torch.device, list[int]] = {}
    for i, n in enumerate(norms):
        groups.setdefault(n.device, []).append(i)
    return {d: (idx, torch.stack([norms[i] for i in idx])) for d, idx in groups.items()}


@dataclass
class _Comparison:
    step: int
    changed: list[tuple[list[int], torch.Tensor, torch.cuda.Event | None]]

    def ready(self) -> bool:
        return all(event is None or event.query() for *_, event in self.changed)


class ParameterFingerprint:
    """Fingerprints of a fixed list of parameters; :meth:`take` a baseline, :meth:`compare` later, collect the
    results with :meth:`ready`."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self._baseline: dict[torch.device, tuple[list[int], torch.Tensor]] | None = None
        self._pending: deque[_Comparison] = deque()

    @property
    def has_baseline(self) -> bool:
        return self._baseline is not None

    def take(self) -> None:
        """Record the parameters' current fingerprint as the baseline (kernels launched, nothing read)."""
        with torch.no_grad():
            self._baseline = _by_device(tensor_norms([p.detach() for p in self.params], 2.0))

    def clear(self) -> None:
        self._baseline = None

    def compare(self, step: int) -> None:
        """Queue the comparison of the current fingerprint with the baseline (then dropped) for DP step ``step``."""
        base, self._baseline = self._baseline, None
        if base is None:
            return
        with torch.no_grad():
            now = _by_device(tensor_norms([p.detach() for p in self.params], 2.0))
            changed = []
            for device, (idx, before) in base.items():
                after = now[device][1]
                diff = (after != before) & ~(after.isnan() & before.isnan())  # NaN weights stay NaN: unchanged
                event = None
                if device.type == "cuda":
                    host = torch.empty(diff.shape, dtype=torch.bool, pin_memory=True)
                    host.copy_(diff, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record()
                else:
                    host = diff.cpu()  # CPU: the tensor itself; another accelerator is read now
                changed.append((idx, host, event))
        self._pending.append(_Comparison(step, changed))

    def ready(self) -> list[tuple[int, list[int]]]:
        """Comparisons the device has finished: ``(step, indices of changed parameters)`` for those that changed."""
        out = []
        while self._pending and self._pending[0].ready():
            comparison = self._pending.popleft()
            moved = [idx[j] for idx, host, _ in comparison.changed for j in host.nonzero().flatten().tolist()]
            if moved:
                out.append((comparison.step, sorted(moved)))
        return out
