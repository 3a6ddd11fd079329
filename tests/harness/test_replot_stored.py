"""The stored evidence replots to what it says: the analysis recomputed from every stored grid and federated JSON
under ``docs/results/`` (what ``--replot`` writes) equals the analysis stored with its runs, number for number
(up to float rounding in the last bits; p-values and Holm adjustments added since are not in the older files)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("datasets")
from dp_bench.commands import federated_report, grid  # noqa: E402
from repo_support import RESULTS

ADDED_SINCE = ("p", "p_holm", "verdict")


def stored(kind: str) -> list[Path]:
    """The result files of ``kind`` ("grid": a dict of runs and lr choices; "federated": a list of runs)."""
    out = []
    for path in sorted(RESULTS.glob("*.json")):
        r = json.loads(path.read_text())
        if not isinstance(r, dict) or "analysis" not in r:
            continue
        is_grid = isinstance(r.get("runs"), dict) and "lr_choice" in r
        is_federated = isinstance(r.get("runs"), list) and str(r.get("command", "")).startswith("dp-bench federated")
        if (kind == "grid" and is_grid) or (kind == "federated" and is_federated):
            out.append(path)
    return out


def assert_same(old: Any, new: Any, where: str = "") -> None:
    """Equal, floats to 1e-9 relative (NaN equals NaN); keys added since the file was written are ignored."""
    if isinstance(old, dict):
        assert isinstance(new, dict), where
        old_keys = {k for k in old if k not in ADDED_SINCE}
        assert old_keys <= set(new), (where, sorted(old_keys - set(new)))
        for k in old_keys:
            assert_same(old[k], new[k], f"{where}/{k}")
    elif isinstance(old, list):
        assert isinstance(new, list) and len(old) == len(new), where
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(old, float) or isinstance(new, float):
        a, b = float(old), float(new)
        assert (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12), (where, a, b)
    else:
        assert old == new, (where, old, new)


def as_json(x: Any) -> Any:
    return json.loads(json.dumps(x, default=float))


def test_there_is_stored_evidence_to_replot() -> None:
    assert len(stored("grid")) >= 7 and len(stored("federated")) >= 2


@pytest.mark.parametrize("path", stored("grid"), ids=lambda p: p.stem)
def test_stored_grid_replots_to_its_analysis(path: Path) -> None:
    result = json.loads(path.read_text())
    report = grid.report_for(result)
    assert_same(as_json(result["analysis"]), as_json(report.analyze(result)))
    assert report.tables(result)  # the tables are built from it without error


@pytest.mark.parametrize("path", stored("federated"), ids=lambda p: p.stem)
def test_stored_federated_grid_replots_to_its_analysis(path: Path) -> None:
    result = json.loads(path.read_text())
    assert_same(as_json(result["analysis"]), as_json(federated_report.analyze(result)))
    assert federated_report.tables(result)
