"""DP federated LoRA fine-tuning of a text classifier on a CSV with ``peft-lalora federate``, and the adapter it saves.

What it shows:
* the one command of docs/federated.md on a model folder and a CSV: clients get Dirichlet label-skewed shares of the
  CSV, train the LoRA factors with DP-SGD (each client's ε at δ in the result), and the server averages LoRA A,
  LoRA B and the head separately;
* ``--save-adapter DIR``: the trained global adapter as a PEFT adapter (DIR, loaded with
  ``PeftModel.from_pretrained`` after ``import peft_lalora``) and as a plain LoRA copy (DIR/lora, plain PEFT);
* loading the adapter and classifying new text with it.

Without ``--model`` / ``--data`` the script first writes a toy model folder (a small BERT with random weights and a
ten-word WordPiece tokenizer, built from a ``BertConfig``: nothing is downloaded) and a toy reviews CSV; give your own
model folder (anything ``AutoModelForSequenceClassification`` and ``AutoTokenizer`` load) and CSV instead.

Run (from a clone, after the README's install line):
    python examples/federate_csv.py --model ./my-bert --data reviews.csv --text-column review --label-column sentiment
    python examples/federate_csv.py              # the toy model and CSV at real size: 8 clients, 10 rounds (~8 min)
    python examples/federate_csv.py --tiny       # ~a minute: 2 clients, 1 round (what the tests run)
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

WORDS = ["good", "great", "fine", "bad", "awful", "poor", "movie", "plot", "the", "was"]


def write_toy_model(folder: Path, hidden: int) -> None:
    """A random-weight BERT sequence classifier with its own WordPiece tokenizer, saved as a model folder."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    # transformers 5 takes the vocabulary itself (``vocab=``); a ``vocab_file=`` keyword is silently ignored
    tokenizer = BertTokenizer(vocab={token: i for i, token in enumerate(tokens)})
    assert tokenizer.tokenize("the movie was good") == ["the", "movie", "was", "good"]
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tokens),
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=64,
        num_labels=2,
        initializer_range=0.2,  # random weights whose [CLS] output still depends on the words (0.02: it hardly does)
    )
    BertForSequenceClassification(config).save_pretrained(folder)


def write_toy_csv(path: Path, rows: int) -> None:
    """Reviews "the movie was <adjective>" labelled pos / neg by the adjective."""
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["review", "sentiment"])
        for i in range(rows):
            pos = i % 2 == 0
            adjective = (["good", "great", "fine"] if pos else ["bad", "awful", "poor"])[i % 3]
            out.writerow([f"the movie was {adjective}", "pos" if pos else "neg"])


def federate_command(args: argparse.Namespace, result: Path, adapter: Path) -> list[str]:
    """The ``peft-lalora federate`` command line (printed, then run)."""
    cli = shutil.which("peft-lalora")
    head = [cli] if cli else [sys.executable, "-m", "peft_lalora.cli"]
    size = ["--num-clients", "2", "--rounds", "1", "--local-steps", "2", "--batch-size", "8", "--seq-len", "8"]
    if not args.tiny:
        size = ["--num-clients", "8", "--rounds", "10", "--local-steps", "5", "--batch-size", "32"]
    return [
        *head,
        "federate",
        *["--model", str(args.model), "--data", str(args.data)],
        *["--text-column", args.text_column, "--label-column", args.label_column],
        *size,
        *["--alpha", "1", "--epsilon", "3", "--seed", "0", "--no-progress"],
        *["--out", str(result), "--save-adapter", str(adapter)],
    ]


def classify(model_dir: Path, adapter: Path, texts: list[str], num_labels: int) -> list[int]:
    """Load the saved adapter on the base model and predict a class index for each text."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    import peft_lalora  # noqa: F401 - registers the LALORA adapter type with PEFT

    base = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=num_labels)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    batch = AutoTokenizer.from_pretrained(model_dir)(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**batch).logits.argmax(dim=-1).tolist()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="~a minute at toy size (what the tests run)")
    p.add_argument("--model", type=Path, help="your model folder (default: a toy one written to --workdir)")
    p.add_argument("--data", type=Path, help="your CSV (default: a toy one written to --workdir)")
    p.add_argument("--text-column", default="review")
    p.add_argument("--label-column", default="sentiment")
    p.add_argument("--workdir", type=Path, default=Path("federate-example"), help="where everything is written")
    args = p.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        args.model = args.workdir / "model"
        write_toy_model(args.model, hidden=32 if args.tiny else 128)
    if args.data is None:
        args.data = args.workdir / "reviews.csv"
        write_toy_csv(args.data, rows=80 if args.tiny else 4000)
    result, adapter = args.workdir / "result.json", args.workdir / "adapter"
    command = federate_command(args, result, adapter)
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True)

    run = json.loads(result.read_text())
    print(f"accuracy per round {run['accuracy']}, each client's ε {run['epsilon']} at δ = {run['privacy']['delta']}")
    with args.data.open(newline="") as f:  # string labels are encoded in sorted order (docs/federated.md)
        names = sorted({row[args.label_column] for row in csv.DictReader(f)})
    texts = ["the movie was great", "the plot was awful"]
    predicted = classify(args.model, adapter, texts, num_labels=len(names))
    print("predictions:", {text: names[i] for text, i in zip(texts, predicted, strict=True)})


if __name__ == "__main__":
    main()
