"""`peft-lalora federate` input handling: every malformed table is a one-line error naming the file, the
line/record and the column (never a traceback, never silently filled with nulls); a huge text cell is cut by
characters before tokenization without changing the tokens kept."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("opacus_spectral")
pytest.importorskip("flwr_datasets")

from peft_lalora.cli import main  # noqa: E402
from peft_lalora.federated.data.truncation import char_bound, cut_texts  # noqa: E402

WORDS = ["good", "great", "fine", "bad", "awful", "poor", "movie", "plot", "the", "was"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny BERT with its own WordPiece tokenizer, saved like a user's model folder."""
    from text_support import tiny_bert
    from transformers import BertTokenizerFast

    root = tmp_path_factory.mktemp("model")
    (root / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]))
    BertTokenizerFast(vocab_file=str(root / "vocab.txt")).save_pretrained(root / "m")
    tiny_bert(num_labels=2, seed=0).save_pretrained(root / "m")
    return root / "m"


def _good_rows(n: int = 12) -> list[tuple[str, str]]:
    return [(f"the movie was {WORDS[i % 6]}", "pos" if i % 6 < 3 else "neg") for i in range(n)]


def _csv(rows: list[str]) -> str:
    return "review,sentiment\n" + "".join(r + "\n" for r in rows)


def _jsonl(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)


_GOOD_CSV = [f"{t},{y}" for t, y in _good_rows()]
_GOOD_JSONL = [json.dumps({"review": t, "sentiment": y}) for t, y in _good_rows()]

# name -> (file name, content, extra flags, fragments the one error line must contain)
CASES = {
    "ragged row, extra field": (
        "r.csv",
        _csv([*_GOOD_CSV[:3], "bad,neg,extra", *_GOOD_CSV[3:]]),
        [],
        ["r.csv:5:", "record 4", "3 fields", "'sentiment'"],
    ),
    "ragged row, missing field": (
        "r.csv",
        _csv([*_GOOD_CSV[:2], "the plot was bad", *_GOOD_CSV[2:]]),
        [],
        ["r.csv:4:", "record 3", "no cell for column(s) 'sentiment'"],
    ),
    "unterminated quote": (
        "q.csv",
        _csv([*_GOOD_CSV[:2], '"the plot was bad,neg', *_GOOD_CSV[2:]]),
        [],
        ["q.csv:4:", "record 3", "column 'review'", "never closes"],
    ),
    "invalid JSONL line": (
        "j.jsonl",
        _jsonl([*_GOOD_JSONL[:1], '{"review": "bad", "sentiment": ', *_GOOD_JSONL[1:]]),
        [],
        ["j.jsonl:2:", "record 2", "invalid JSON"],
    ),
    "record of another schema": (
        "s.jsonl",
        _jsonl([*_GOOD_JSONL[:2], json.dumps({"text": "bad", "label": 0}), *_GOOD_JSONL[2:]]),
        [],
        ["s.jsonl:3:", "record 3", "no 'review' field (text column)"],
    ),
    "JSONL labels of two kinds": (
        "k.jsonl",
        _jsonl([*_GOOD_JSONL[:3], json.dumps({"review": "bad", "sentiment": 1}), *_GOOD_JSONL[3:]]),
        [],
        ["k.jsonl:4:", "record 4", "column 'sentiment'", "is an integer"],
    ),
    "empty text cell": (
        "e.csv",
        _csv([*_GOOD_CSV[:1], ",neg", *_GOOD_CSV[1:]]),
        [],
        ["e.csv:3:", "record 2", "empty text cell, column 'review'"],
    ),
    "empty label cell": (
        "e.csv",
        _csv([*_GOOD_CSV[:4], "the plot was bad,", *_GOOD_CSV[4:]]),
        [],
        ["e.csv:6:", "record 5", "empty label cell, column 'sentiment'"],
    ),
    "empty JSONL text": (
        "e.jsonl",
        _jsonl([*_GOOD_JSONL[:1], json.dumps({"review": " ", "sentiment": "pos"}), *_GOOD_JSONL[1:]]),
        [],
        ["e.jsonl:2:", "record 2", "empty text cell, column 'review'"],
    ),
    "NA read as missing": (
        "n.csv",
        _csv([*_GOOD_CSV[:6], "NA,pos", *_GOOD_CSV[6:]]),
        [],
        ["n.csv", "record 7", "column 'review'", "NA"],
    ),
    "float labels": (
        "f.csv",
        _csv([f"{t},{0.5 * (i % 3)}" for i, (t, _) in enumerate(_good_rows())]),
        [],
        ["f.csv", "record 2", "column 'sentiment'", "floats"],
    ),
    "label column named twice (before: pandas used the first, silently)": (
        "d.csv",
        "review,sentiment,sentiment\n"
        + "".join(f"{t},{y},{'neg' if y == 'pos' else 'pos'}\n" for t, y in _good_rows(12)),
        [],
        ["d.csv:1:", "column 'sentiment' is named twice in the header (fields 2 and 3)"],
    ),
    "another column named twice": (
        "d.csv",
        "review,film,sentiment,film\n" + "".join(f"{t},a,{y},b\n" for t, y in _good_rows()),
        [],
        ["d.csv:1:", "column 'film' is named twice in the header (fields 2 and 4)"],
    ),
    "JSONL field named twice (before: json kept the last, silently)": (
        "d.jsonl",
        _jsonl([*_GOOD_JSONL[:2], '{"review": "bad", "sentiment": "neg", "sentiment": "pos"}', *_GOOD_JSONL[2:]]),
        [],
        ["d.jsonl:3:", "record 3", "field 'sentiment' twice"],
    ),
    "same text and label column": (
        "c.csv",
        _csv(_GOOD_CSV),
        ["--label-column", "review"],
        ["--text-column and --label-column are both 'review'"],
    ),
    "missing column": (
        "m.csv",
        _csv(_GOOD_CSV),
        ["--group-column", "film", "--partition", "group"],
        ["m.csv:1:", "column 'film' (--group-column)", "not in the header"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_table_is_a_one_line_error_naming_file_line_and_column(case, model_dir, tmp_path, capsys):
    name, content, extra, fragments = CASES[case]
    data = tmp_path / name
    data.write_text(content)
    argv = [
        "federate",
        "--model",
        str(model_dir),
        "--data",
        str(data),
        "--text-column",
        "review",
        "--label-column",
        "sentiment",
        *extra,
        "--num-clients",
        "2",
        "--rounds",
        "1",
        "--seq-len",
        "8",
        "--no-progress",
        "--out",
        str(tmp_path / "res.json"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = next(x for x in err.splitlines() if x.startswith("peft-lalora federate: error:"))
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    assert not (tmp_path / "res.json").exists()


def test_saved_dataset_with_a_missing_text_is_named_by_record(model_dir, tmp_path, capsys):
    import datasets

    rows = _good_rows()
    texts = [t for t, _ in rows]
    texts[4] = None
    datasets.Dataset.from_dict({"review": texts, "sentiment": [y for _, y in rows]}).save_to_disk(str(tmp_path / "d"))
    argv = [
        "federate",
        "--model",
        str(model_dir),
        "--data",
        str(tmp_path / "d"),
        "--text-column",
        "review",
        "--label-column",
        "sentiment",
        "--out",
        str(tmp_path / "res.json"),
    ]
    assert main(argv) == 2
    assert "record 5: empty or missing text cell, column 'review'" in capsys.readouterr().err


def test_valid_csv_with_quotes_and_blank_lines_still_loads(model_dir, tmp_path):
    from peft_lalora.federated.config import FederationConfig
    from peft_lalora.federated.data.task import build_task

    rows = [f'"{t}, really",{y}' for t, y in _good_rows()] + ["", '"the ""plot"" was\nbad",neg']
    (tmp_path / "ok.csv").write_text(_csv(rows))
    cfg = FederationConfig(
        model=str(model_dir), data=str(tmp_path / "ok.csv"), text_column="review", label_column="sentiment", seq_len=8
    )
    task = build_task(cfg)
    assert len(task.train) + len(task.test) == 13 and task.num_labels == 2


# ------------------------------------------------------------------------------------ huge cells
def _tokenizers(model_dir):
    """The WordPiece tokenizer of the model folder, and a byte-level BPE trained here (GPT-2 style)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        [" ".join(WORDS) + ", the plot!"] * 50, vocab_size=300, min_frequency=1, special_tokens=["<pad>"]
    )
    wrapped = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token="<pad>")  # the tokenizers.Tokenizer
    return {"wordpiece": AutoTokenizer.from_pretrained(model_dir), "bpe": wrapped}


@pytest.mark.parametrize("kind", ["wordpiece", "bpe"])
def test_cut_keeps_the_tokens_of_the_full_text(kind, model_dir):
    import numpy as np

    tok = _tokenizers(model_dir)[kind]
    rng = np.random.default_rng(0)
    pieces = [*WORDS, ",", "!", " ", "  ", "\n", "unknownword", "plot."]
    for max_length in (8, 16, 64):
        text = " ".join(rng.choice(pieces, size=6000).tolist())
        spaces = "good " + " " * (3 * char_bound(tok, max_length)) + "bad movie " * 50
        giant = "x" * (3 * char_bound(tok, max_length))  # one word: never cut
        cut = cut_texts([text, spaces, giant], tok, max_length)
        assert len(cut[0]) <= char_bound(tok, max_length) < len(text)
        assert cut[2] == giant
        if kind == "wordpiece":  # whitespace is no token: the cut holds < max_length tokens, so it is not used
            assert cut[1] == spaces
        kw = dict(truncation=True, max_length=max_length, padding="max_length")
        assert tok(cut, **kw)["input_ids"] == tok([text, spaces, giant], **kw)["input_ids"]


def test_a_huge_cell_is_not_tokenized_whole(model_dir, tmp_path):
    """One 20 MB review: the task tokenizes it to the ids of its first words, fast (tokenizing it whole is the
    slow part without the cut)."""
    from peft_lalora.federated.config import FederationConfig
    from peft_lalora.federated.data.task import build_task
    from transformers import AutoTokenizer

    huge = "the movie was good " * 1_050_000  # 20 MB
    rows = [*_good_rows(), (huge, "pos")]
    with (tmp_path / "big.csv").open("w") as f:
        f.write("review,sentiment\n" + "".join(f"{t},{y}\n" for t, y in rows))
    cfg = FederationConfig(
        model=str(model_dir),
        data=str(tmp_path / "big.csv"),
        text_column="review",
        label_column="sentiment",
        seq_len=16,
        test_fraction=0.25,
    )
    t0 = time.perf_counter()
    task = build_task(cfg)  # reads, checks and tokenizes both splits
    ids = [*task.train.with_format(None)["input_ids"], *task.test.with_format(None)["input_ids"]]
    build_s = time.perf_counter() - t0
    tok = AutoTokenizer.from_pretrained(model_dir)
    expected = tok(huge[:2000], truncation=True, max_length=16, padding="max_length")["input_ids"]
    assert expected in [list(x) for x in ids]
    assert build_s < 8.0, f"building the task took {build_s:.1f}s"
