"""The private ``transformers.Trainer`` members DPTrainer relies on (``PRIVATE_TRAINER_API``, docs/trainer.md "Private
Trainer methods") exist on the installed transformers with the parameters DPTrainer expects, its overrides are still
called by the Trainer, every method DPTrainer redefines keeps the Trainer's parameters, and none of DPTrainer's own
private names collides with one of the Trainer's. The ``compat`` tox env runs this against the newest transformers."""

from __future__ import annotations

import inspect
import re

import pytest
import transformers
from opacus_spectral.hf import dp_trainer
from opacus_spectral.hf.dp_trainer import PRIVATE_TRAINER_API, DPTrainer
from trainer_support import lalora_model, trainer
from transformers import Trainer

PRIVATE = sorted(PRIVATE_TRAINER_API)


def parameters(fn) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(fn).parameters if p != "self")


@pytest.mark.parametrize("name", [n for n in PRIVATE if PRIVATE_TRAINER_API[n][0] != "attribute"])
def test_each_private_method_exists_with_the_expected_parameters(name):
    kind, expected = PRIVATE_TRAINER_API[name]
    assert callable(getattr(Trainer, name, None)), f"transformers {transformers.__version__} has no Trainer.{name}"
    assert parameters(getattr(Trainer, name)) == expected, transformers.__version__
    if kind == "override":
        assert parameters(getattr(DPTrainer, name)) == expected
        assert re.search(rf"self\.{name}\(", inspect.getsource(Trainer)), f"the Trainer no longer calls {name}"


def test_the_private_attributes_are_set_by_the_trainer(tmp_path):
    t = trainer(tmp_path)
    for name in (n for n in PRIVATE if PRIVATE_TRAINER_API[n][0] == "attribute"):
        assert name in vars(t) and name not in vars(DPTrainer), name


def test_every_method_dptrainer_redefines_keeps_the_trainers_parameters():
    """Public and private: a renamed parameter would reach DPTrainer's override by position or not at all.
    ``*args, **kwargs`` pass-throughs forward whatever the Trainer passes."""
    redefined = [n for n, v in vars(DPTrainer).items() if inspect.isfunction(v) and hasattr(Trainer, n)]
    assert {"training_step", "create_optimizer", "log", "_save"} <= set(redefined)
    for name in redefined:
        ours = inspect.signature(getattr(DPTrainer, name)).parameters.values()
        if name == "__init__" or any(p.kind is p.VAR_POSITIONAL for p in ours):
            continue
        assert parameters(getattr(DPTrainer, name)) == parameters(getattr(Trainer, name)), name


def test_dptrainers_own_private_names_are_not_the_trainers(tmp_path):
    """A Trainer release adding a private member of the same name would be silently overridden (or overwritten)."""
    source = inspect.getsource(dp_trainer)
    own = set(re.findall(r"self\.(_[a-z]\w*)\s*(?::[^=\n]+)?=", source))
    own |= {n for n in vars(DPTrainer) if n.startswith("_") and not n.startswith("__")}
    own -= set(PRIVATE_TRAINER_API)
    assert {"_dp", "_denoisers", "_attach_alternation", "_release"} <= own
    plain = Trainer(model=lalora_model(), args=trainer(tmp_path).args)
    taken = sorted(n for n in own if hasattr(Trainer, n) or n in vars(plain))
    assert taken == [], f"transformers {transformers.__version__} defines {taken}"
