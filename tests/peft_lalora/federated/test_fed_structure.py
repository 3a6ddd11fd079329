"""How the federated package is put together: the run's configuration reaches the client settings and the task
settings by explicit construction (a field added on one side fails here until the builder names it), the
configuration imports none of its builders, no import circle among the package's modules and the Flower deployment
behind its subpackage."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from repo_support import ROOT

pytestmark = pytest.mark.slow

PACKAGE = ROOT / "peft_lalora" / "src" / "peft_lalora" / "federated"


def _recorder(monkeypatch, module, name):
    """Replace ``module.name`` by a function that records the keywords it is called with."""
    seen: dict = {}

    def record(**kw):
        seen.update(kw)
        return kw

    monkeypatch.setattr(module, name, record)
    return seen


def test_client_config_names_every_client_config_field(monkeypatch):
    from peft_lalora.federated import builders
    from peft_lalora.federated.client.dp_client import ClientConfig
    from peft_lalora.federated.config import FederationConfig

    seen = _recorder(monkeypatch, builders, "ClientConfig")
    builders.client_config(FederationConfig())
    fields = {f.name for f in dataclasses.fields(ClientConfig)}
    kept = set(builders.CLIENT_DEFAULTS_KEPT)
    assert not set(seen) & kept, "a field both set and listed as left at its default"
    assert set(seen) | kept == fields, f"not named by client_config: {sorted(fields - set(seen) - kept)}"


def test_client_config_carries_the_run_values():
    from peft_lalora.federated.builders import client_config
    from peft_lalora.federated.config import FederationConfig

    cfg = FederationConfig(
        local_steps=7, batch_size=3, lr=0.25, optimizer="sgd", weight_decay=0.5, b_lr_ratio=2.0, max_grad_norm=0.7
    )
    cc = client_config(cfg)
    for name in ("local_steps", "batch_size", "lr", "optimizer", "weight_decay", "b_lr_ratio", "max_grad_norm"):
        assert getattr(cc, name) == getattr(cfg, name), name
    assert (cc.target_epsilon, cc.planned_steps, cc.noise_multiplier) == (cfg.epsilon, 3 * 7, None)
    plain = client_config(FederationConfig(epsilon=0, noise_multiplier=1.5, delta=1e-6, accountant="prv"))
    assert (plain.noise_multiplier, plain.target_epsilon, plain.delta, plain.accountant) == (1.5, None, 1e-6, "prv")


def test_task_settings_name_every_task_settings_field(monkeypatch):
    from peft_lalora.federated import config

    cfg = config.FederationConfig(seed=5, n_train=9)
    fields = {f.name for f in dataclasses.fields(config.TaskSettings)}
    seen = _recorder(monkeypatch, config, "TaskSettings")
    cfg.task_settings()
    assert set(seen) == fields
    assert seen["seed"] == 5 and seen["n_train"] == 9


def test_task_factories_get_the_task_settings():
    from peft_lalora.federated.config import FederationConfig, TaskSettings
    from peft_lalora.federated.data.task import build_task

    cfg = FederationConfig(task="fed_tiny:tiny", n_train=24, n_test=8, seed=3)
    task = build_task(cfg)
    assert task.key == dataclasses.asdict(cfg.task_settings()) == cfg.task_key()
    assert build_task(cfg.task_settings()).key == task.key
    with pytest.raises(ValueError, match="test_fraction"):
        TaskSettings(test_fraction=1.0)


def _imported_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint(' '.join(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return set(out.stdout.split())


def test_the_config_imports_none_of_its_builders():
    mods = _imported_after("import peft_lalora.federated.config")
    builders = (
        "builders",
        "data.task",
        "client.dp_client",
        "server.rounds",
        "simulation",
        "data.partition",
        "flower.client_app",
        "flower.server_app",
        "flower.strategy",
        "server.plan",
        "server.evaluate",
    )
    assert not {f"peft_lalora.federated.{m}" for m in builders} & mods


def test_the_flower_and_launcher_subpackages_import_flower_only_with_its_app():
    assert not {"flwr", "cryptography"} & _imported_after("import peft_lalora.federated.flower")
    assert not {"flwr", "cryptography"} & _imported_after("import peft_lalora.federated.launcher")
    assert "flwr" not in _imported_after("from peft_lalora.federated.launcher import run_flower, LocalFederation")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(("peft_lalora", *parts))


def _top_level_imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """Package modules imported when ``path`` is imported: module level, not under ``if TYPE_CHECKING``."""
    is_package = path.name == "__init__.py"
    base = name if is_package else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
                target = f"{anchor}.{node.module}" if node.module else anchor
            else:
                target = node.module or ""
            candidates = [target, *(f"{target}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        out |= {c for c in candidates if c in modules and c != name}
    return out


def test_no_import_circle_among_the_federated_modules():
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: _top_level_imports(path, name, set(files)) for name, path in files.items()}
    assert graph["peft_lalora.federated.builders"] >= {
        "peft_lalora.federated.config",
        "peft_lalora.federated.data.task",
    }
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            pytest.fail("import circle: " + " -> ".join([*stack[stack.index(node) :], node]))
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, [*stack, node])
        done.add(node)

    for name in sorted(graph):
        visit(name, [])


def test_one_table_between_algo_and_alternation():
    from peft_lalora.federated.builders import make_peft_config
    from peft_lalora.federated.config import ALGORITHMS, FederationConfig

    assert sorted(ALGORITHMS.values()) == ["freeze_a", "none", "round", "step"]
    for algo, mode in ALGORITHMS.items():
        cfg = FederationConfig(algo=algo)
        assert cfg.alternation == make_peft_config(cfg).alternation == mode
