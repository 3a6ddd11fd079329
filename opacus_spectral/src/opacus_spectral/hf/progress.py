"""``DPTrainer``'s progress bar (``docs/trainer.md``, "Not private, so not logged"): steps and ε, no timing.

The Trainer's default bar (``ProgressCallback``, tqdm; ``NotebookProgressCallback`` in a notebook) prints each
step's rate and the elapsed and remaining time. A DP step's time grows with its Poisson batch size (measured
correlation 0.80), so the rate releases the unnoised size of every sampled batch — the reason ``train_runtime`` is
not logged (:mod:`~opacus_spectral.hf.logs`). :class:`DPProgressCallback` replaces it unless
``release_nonprivate_stats=True``: a bar of the step count and the ε of the last log record, redrawn at every update
(``mininterval=0``, so even *when* it redraws does not depend on time), and an evaluation bar of the batch count; log
records are printed as the default bar prints them (already filtered by ``DPTrainer.log``).
"""

from __future__ import annotations

import warnings
from typing import Any

from tqdm import tqdm
from transformers import ProgressCallback
from transformers.trainer_utils import has_length

__all__ = ["BAR_FORMAT", "DPProgressCallback", "install_progress"]

#: tqdm's fields without ``elapsed``, ``remaining``, ``rate``
BAR_FORMAT = "{desc}{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}{postfix}"
_TIMED_BARS = ("ProgressCallback", "NotebookProgressCallback")


def _bar(total: int, **kw: Any) -> tqdm:
    return tqdm(total=total, bar_format=BAR_FORMAT, mininterval=0, miniters=1, dynamic_ncols=True, **kw)


class DPProgressCallback(ProgressCallback):
    """The Trainer's progress bar without timing: steps, ε (at each log record), the evaluation's batches."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self.training_bar = _bar(state.max_steps)
        self.current_step = 0

    def on_prediction_step(self, args: Any, state: Any, control: Any, eval_dataloader: Any = None, **kwargs: Any):
        if state.is_world_process_zero and has_length(eval_dataloader):
            if self.prediction_bar is None:
                self.prediction_bar = _bar(len(eval_dataloader), leave=self.training_bar is None)
            self.prediction_bar.update(1)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if state.is_world_process_zero and self.training_bar is not None and logs and "epsilon" in logs:
            self.training_bar.set_postfix_str(f"ε={logs['epsilon']:.4g}", refresh=True)
        super().on_log(args, state, control, logs=logs, **kwargs)


def _timed(callback: Any) -> bool:
    """The Trainer's own bars and their subclasses (by class name: a notebook's is recognised without IPython)."""
    names = {c.__name__ for c in type(callback).__mro__}
    return not isinstance(callback, DPProgressCallback) and bool(names & set(_TIMED_BARS))


def install_progress(trainer: Any) -> None:
    """Replace every timed progress bar among ``trainer``'s callbacks by one :class:`DPProgressCallback` (none is
    added where there was none: ``disable_tqdm=True``), unless ``release_nonprivate_stats``."""
    if trainer.args.release_nonprivate_stats:
        return
    handler = trainer.callback_handler
    timed = [cb for cb in handler.callbacks if _timed(cb)]
    for cb in timed:
        handler.remove_callback(cb)
        if type(cb).__name__ not in _TIMED_BARS:
            warnings.warn(
                f"DPTrainer replaced the progress bar {type(cb).__name__} by DPProgressCallback: a bar that prints "
                "each step's time releases the Poisson batch size. Pass release_nonprivate_stats=True to keep it "
                "(NOT private).",
                RuntimeWarning,
                stacklevel=3,
            )
    if timed and not any(isinstance(cb, DPProgressCallback) for cb in handler.callbacks):
        handler.add_callback(DPProgressCallback())
