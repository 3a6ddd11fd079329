"""Cut texts by characters before tokenizing them, without changing the tokens kept.

A tokenizer called with ``truncation=True, max_length=n`` still tokenizes the *whole* text and then drops all
but the first ``n`` tokens: one 23 MB cell cost 3.4 GB and 41 s. The rule here:

* a text longer than ``bound = 2 · max_length · (L + 1)`` characters, where ``L`` is the length of the
  tokenizer's longest vocabulary entry, is cut to its first ``bound`` characters and then back to the last
  whitespace before that point (no whitespace: no cut), so that no word is split (WordPiece, byte-level BPE
  and Metaspace pre-tokenizers tokenize each word on its own, so the prefix's tokens are the text's first ones);
* the cut is kept only if the prefix alone still has at least ``max_length`` tokens (without special
  tokens); otherwise — a long run of whitespace, or one giant word — the full text is tokenized (exact, slow).

So the kept tokens are the same as without the cut (:func:`cut_texts`; tested in
``tests/peft_lalora/federated/test_fed_inputs.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["char_bound", "cut_texts"]


def char_bound(tokenizer: Any, max_length: int) -> int:
    """``2 · max_length · (L + 1)`` characters, ``L`` the longest vocabulary entry (cached on the tokenizer)."""
    longest = getattr(tokenizer, "_lalora_longest_token", None)
    if longest is None:
        longest = max((len(t) for t in tokenizer.get_vocab()), default=16)
        tokenizer._lalora_longest_token = longest
    return 2 * int(max_length) * (int(longest) + 1)


def _cut(text: str, bound: int) -> str | None:
    """The first ``bound`` characters back to the last whitespace (``None`` if there is none: one giant word)."""
    head = text[:bound]
    space = max(head.rfind(c) for c in " \t\n\r")
    return head[:space] if space > 0 else None


def cut_texts(texts: Sequence[Any], tokenizer: Any, max_length: int) -> list[Any]:
    """``texts`` with every text longer than :func:`char_bound` replaced by a prefix whose first ``max_length``
    tokens are the text's (see the module docstring); other entries unchanged."""
    bound = char_bound(tokenizer, max_length)
    out = list(texts)
    for i, text in enumerate(out):
        if isinstance(text, str) and len(text) > bound:
            prefix = _cut(text, bound)
            if prefix is not None and len(tokenizer(prefix, add_special_tokens=False)["input_ids"]) >= max_length:
                out[i] = prefix
    return out
