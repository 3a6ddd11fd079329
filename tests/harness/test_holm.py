"""Multiple comparisons: Holm's step-down adjustment, the paired t-test p-value behind it, and the report tables
that print it beside every paired interval — without changing any number the tables printed before."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from dp_bench.analysis import holm, holm_family, paired_ci
from dp_bench.commands import federated, federated_report, grid, grid_report
from repo_support import RESULTS


def test_holm_matches_a_hand_computation() -> None:
    # sorted: 0.005×4 = 0.02; 0.01×3 = 0.03; 0.03×2 = 0.06; 0.04×1 = 0.04 -> monotone: 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # NaN (no interval) stays NaN and does not count in m
    out = holm([0.01, float("nan"), 0.04, 0.03, 0.005])
    assert math.isnan(out[1]) and [out[i] for i in (0, 2, 3, 4)] == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.6]) == [1.0, 1.0]  # 0.5×2 = 1.0 caps, the larger p cannot fall below it
    assert holm([0.2]) == [0.2] and holm([]) == []


def test_holm_rejects_where_bonferroni_does_not() -> None:
    """The §7.6 situation: a p of 0.0009 among 70 fails Bonferroni (× 70 = 0.063) but passes Holm when 30
    smaller p-values precede it (× 40 = 0.036)."""
    ps = [1e-5] * 30 + [0.0009] + [0.5] * 39
    assert 70 * 0.0009 > 0.05 and holm(ps)[30] == pytest.approx(40 * 0.0009)


def test_paired_t_test_p_value_is_exact() -> None:
    """diffs 1, 2, 3: t = 2 / (1/√3) = √12 on 2 df, whose two-sided p has the closed form 1 − t/√(2 + t²)."""
    ci = paired_ci([1.0, 2.0, 3.0])
    assert ci["p"] == pytest.approx(1 - math.sqrt(12 / 14), rel=1e-9)
    assert paired_ci([0.5, 0.5, 0.5])["p"] == 0.0 and paired_ci([0.0, 0.0])["p"] == 1.0  # zero spread
    assert math.isnan(paired_ci([0.3])["p"]) and math.isnan(paired_ci([])["p"])
    family = [paired_ci([1.0, 2.0, 3.0]), paired_ci([0.3]), paired_ci([0.1, 0.2, 0.4])]
    holm_family(family)
    assert family[0]["p_holm"] == pytest.approx(min(1.0, 2 * max(family[0]["p"], family[2]["p"] / 2)))
    assert math.isnan(family[1]["p_holm"])


def _drop_holm(table: str) -> str:
    """The tables with every ``Holm p`` column removed (what the report printed before it had one)."""
    out, cols = [], None
    for line in table.splitlines():
        cells = line.split("|")
        if "Holm p" in line:
            cols = {i for i, c in enumerate(cells) if c.strip() == "Holm p"}
        elif not line.startswith("|"):
            cols = None
        out.append("|".join(c for i, c in enumerate(cells) if not cols or i not in cols))
    return "\n".join(out)


def test_grid_replot_prints_the_old_tables_plus_holm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A replot of the stored grid B′ JSON (on a copy: the stored files stay untouched): every number the
    analysis stored at run time is printed unchanged, with the Holm column beside each interval."""
    stored = json.loads((RESULTS / "fmnist_b1024.json").read_text())
    before = grid_report.tables(stored)  # the analysis stored with the runs: no p-values
    shutil.copy(RESULTS / "fmnist_b1024.json", tmp_path)
    grid.main(["--replot", "--out", str(tmp_path), "--name", "fmnist_b1024"])
    after = capsys.readouterr().out
    assert _drop_holm(after).strip() == _drop_holm(before).strip()
    assert "| sgd | 1024 | 1 | ema+rmt | 8 | 82.84 ± 0.19 | +1.02 [+0.70, +1.33] | 0.0068 |" in after
    assert "| sgd | 1024 | 3 | rmt-tw | 1 | 84.10 ± 0.22 | -0.58 [-0.72, -0.45] | 0.0028 |" in after
    assert "| sgd | 1024 | 3 | rmt-tw | ema | +0.11 [-0.33, +0.56] | 1 |" in after
    fam = grid_report.families(json.loads((tmp_path / "fmnist_b1024.json").read_text())["analysis"])
    acc = fam["accuracy_vs_none"]
    assert len(acc) == 10 and [c["p_holm"] for c in acc.values()] == pytest.approx(holm([c["p"] for c in acc.values()]))


def test_federated_replot_prints_the_old_tables_plus_holm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stored = json.loads((RESULTS / "federated_paired.json").read_text())
    before = federated_report.tables(stored)
    out = tmp_path / "federated_paired.json"
    shutil.copy(RESULTS / "federated_paired.json", out)
    federated.main(["--replot", "--out", str(out)])
    after = capsys.readouterr().out
    assert _drop_holm(after).strip() == _drop_holm(before).strip()
    # one family per metric: 4 comparisons at ε = 1
    assert "− LA-LoRA w/o filter (n=5) | +3.4 [+0.8, +6.1] | 0.045 | +4.2 [+2.6, +5.9] | 0.0089 |" in after


@pytest.mark.slow
def test_pooled_holm_over_the_section_counts_every_grid() -> None:
    """§7.2–§7.6: 70 accuracy comparisons; §7.6's `ema`+`rmt` cell passes Holm over them, not Bonferroni."""
    names = ("fmnist_b", "fmnist_b1024", "fmnist_b_adamw", "fmnist_a")
    table = grid_report.pooled_holm([RESULTS / f"{n}.json" for n in names])
    assert table.startswith("accuracy_vs_none: 70 comparisons pooled over 4 grids")
    row = next(line for line in table.splitlines() if "sgd|B1024|eps1|ema+rmt |" in line)
    assert row.endswith("| 8.5e-04 | 0.0068 | 0.035 |")
