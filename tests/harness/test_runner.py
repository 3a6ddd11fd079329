"""The harness's one experiment runner (dp_bench.runner): the key format, tuning rounds from stored runs alone, and
the loop that trains what is missing, stores it, and gives a claim back when it stops early."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dp_bench import runner
from dp_bench.store import SharedResult


def test_one_key_format_for_every_command():
    cell = runner.Cell("tune", "none", 3.0, 100, ("sgd", "B256"))
    assert cell.key(0.5) == runner.run_key("tune", "none", eps=3.0, seed=100, lr=0.5, cell=("sgd", "B256"))
    assert cell.key(0.5) == "tune|none|sgd|B256|eps3|s100|lr0.5"
    assert runner.run_key("eval", "la-lora", eps=1.0, seed=0, lr=2.0) == "eval|la-lora|eps1|s0|lr2"


def test_a_tuning_round_is_a_pure_function_of_the_stored_runs():
    cell = runner.Cell("tune", "m", 3.0, 100)
    runs = {cell.key(lr): {"val": v} for lr, v in ((1.0, 0.5), (2.0, 0.7))}
    runs[runner.Cell("tune", "other", 3.0, 100).key(1.0)] = {"val": 9.0}  # another cell's run is not counted
    metric = lambda r: r["val"]  # noqa: E731
    assert runner.tune_round({}, [cell], [1.0, 2.0], 1, metric) == ([[1.0, 2.0]], None, {})
    todo, best, tried = runner.tune_round(runs, [cell], [1.0, 2.0], 1, metric)
    assert (todo, best, tried) == ([[4.0]], None, {1.0: 0.5, 2.0: 0.7})  # the best at the edge: one step outward
    runs[cell.key(4.0)] = {"val": 0.6}
    assert runner.tune_round(runs, [cell], [1.0, 2.0], 1, metric)[:2] == ([[]], 2.0)


def test_a_tuning_round_over_several_seeds_chooses_by_the_mean_of_rates_stored_for_every_seed():
    """Three tuning seeds (docs/results.md §12.G): a rate counts once every seed has it; the choice is the best
    mean, where one seed alone would choose another rate; an extension is run by each seed that lacks it."""
    cells = [runner.Cell("tune", "m", 3.0, s) for s in (100, 101, 102)]
    metric = lambda r: r["val"]  # noqa: E731
    vals = {100: (0.50, 0.49, 0.40), 101: (0.40, 0.48, 0.41), 102: (0.41, 0.47, 0.40)}  # at lr 1, 2, 4
    runs = {c.key(lr): {"val": v} for c in cells[:2] for lr, v in zip((1.0, 2.0, 4.0), vals[c.seed], strict=True)}
    todo, best, tried = runner.tune_round(runs, cells, [1.0, 2.0, 4.0], 3, metric)
    assert todo == [[], [], [1.0, 2.0, 4.0]] and best is None and tried == {}
    runs.update({cells[2].key(lr): {"val": v} for lr, v in zip((1.0, 2.0, 4.0), vals[102], strict=True)})
    runs[cells[0].key(8.0)] = {"val": 0.9}  # one seed ahead: not counted until every seed has it
    todo, best, tried = runner.tune_round(runs, cells, [1.0, 2.0, 4.0], 3, metric)
    assert todo == [[], [], []] and best == 2.0 and tried[2.0] == pytest.approx(0.48)  # seed 100 alone: lr 1
    runs = {c.key(lr): {"val": lr / 10} for c in cells for lr in (1.0, 2.0)}  # best at the upper edge
    runs[cells[1].key(4.0)] = {"val": 0.1}
    todo, best, _ = runner.tune_round(runs, cells, [1.0, 2.0], 3, metric)
    assert todo == [[4.0], [], [4.0]] and best is None


class _Fixed:
    def lrs(self, cell, result):
        return [0.1]


def test_drive_trains_every_missing_run_once_and_stores_it(tmp_path: Path):
    path = tmp_path / "r.json"
    store = SharedResult(path, {"runs": {}})
    plan = [runner.Cell("eval", m, 1.0, 0) for m in ("a", "b")]
    trained = []

    def train(cell, lr):
        trained.append(cell.key(lr))
        return {"method": cell.method, "wall_seconds": 1.0}

    assert runner.drive(store, plan, _Fixed(), train, desc="t", poll=0.0) is False
    assert trained == ["eval|a|eps1|s0|lr0.1", "eval|b|eps1|s0|lr0.1"]
    assert set(json.loads(path.read_text())["runs"]) == set(trained)
    runner.drive(SharedResult(path, json.loads(path.read_text())), plan, _Fixed(), train, desc="t", poll=0.0)
    assert len(trained) == 2  # a second worker (or --resume) finds nothing to do


def test_drive_stops_early_and_gives_its_claim_back(tmp_path: Path):
    store = SharedResult(tmp_path / "r.json", {"runs": {}})
    plan = [runner.Cell("eval", "a", 1.0, 0)]
    assert runner.drive(store, plan, _Fixed(), lambda c, lr: {}, desc="t", stop=lambda: True, poll=0.0) is True
    assert store.in_flight() == set() and store.keys() == set()


class _Report:
    """A report with every part of the protocol: it counts its calls."""

    def __init__(self) -> None:
        self.plotted: list[Path] = []

    def upgrade(self, result):
        result["runs"] = {f"eval|{k}": v for k, v in result["runs"].items() if not k.startswith("eval|")}
        return result

    def analyze(self, result):
        return {"n": len(result["runs"])}

    def tables(self, result):
        return f"| runs | {result['analysis']['n']} |"

    def plot(self, result, png):
        png.write_text("png")
        self.plotted.append(png)


def test_write_is_atomic_and_replot_reads_the_json_alone(tmp_path: Path, capsys, monkeypatch):
    path, png, report = tmp_path / "sub" / "r.json", tmp_path / "r.png", _Report()
    runner.write({"runs": {"eval|a": {}}}, report, path, png, indent=1)
    assert json.loads(path.read_text())["analysis"] == {"n": 1} and report.plotted == [png]
    assert "| runs | 1 |" in capsys.readouterr().out and not list(path.parent.glob(".*tmp"))
    replaced = []
    monkeypatch.setattr("os.replace", lambda a, b: replaced.append((Path(a).parent, Path(b))))
    runner.write({"runs": {}}, report, path, png)
    assert replaced == [(path.parent, path)]  # written beside the JSON, then renamed over it
    monkeypatch.undo()
    path.write_text(json.dumps({"runs": {"a": {}, "b": {}}}))  # a JSON from before the key format
    assert set(runner.load(path, report)["runs"]) == {"eval|a", "eval|b"}
    out = runner.replot(path, report, png)
    assert out["analysis"] == {"n": 2} and set(json.loads(path.read_text())["runs"]) == {"eval|a", "eval|b"}


def test_a_report_of_tables_only_never_rewrites_the_json(tmp_path: Path, capsys):
    path = tmp_path / "r.json"
    path.write_text('{"cases": {"x": 1}}')
    report = runner.Report(tables=lambda r: f"cases {sorted(r['cases'])}")
    before = path.stat().st_mtime_ns
    assert runner.replot(path, report, None) == {"cases": {"x": 1}}
    assert capsys.readouterr().out == "cases ['x']\n" and path.stat().st_mtime_ns == before
