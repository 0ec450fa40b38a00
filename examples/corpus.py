"""An offline corpus and a word-level tokenizer for the examples (no download, no extra package).

The default text is the help text that ships with every CPython (``pydoc_data.topics``,
about 465k characters). Words and punctuation marks are tokens; the `vocab_size - 1` most
frequent ones get ids by descending count (ties by first occurrence), everything else is
``<unk>`` (id 0) — a Zipfian vocabulary with a long rare tail, as in the AGG paper.
"""

from __future__ import annotations

import re
from collections import Counter

import torch

_TOKEN = re.compile(r"\w+|[^\w\s]")


def load_text(path: str | None = None) -> str:
    """The UTF-8 text at `path`, or Python's bundled help topics."""
    if path:
        with open(path, encoding="utf-8") as f:
            return f.read()
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def tokenize(text: str, vocab_size: int) -> tuple[torch.Tensor, list[str]]:
    """Token ids of `text` (1-D long tensor) and the vocabulary (id -> word, id 0 = <unk>)."""
    words = _TOKEN.findall(text)
    vocab = ["<unk>"] + [w for w, _ in Counter(words).most_common(vocab_size - 1)]
    index = {w: i for i, w in enumerate(vocab)}
    return torch.tensor([index.get(w, 0) for w in words], dtype=torch.long), vocab


class WordTokenizer:
    """The vocabulary as a tokenizer for the offline report (`aniso_plugins.offline.report.analyze`'s
    ``tokenizer=``): ``tokenizer(text, add_special_tokens=False)["input_ids"]``, unknown words -> 0."""

    def __init__(self, vocab: list[str]):
        self.index = {w: i for i, w in enumerate(vocab)}

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [self.index.get(w, 0) for w in _TOKEN.findall(text)]}


def hf_tokenizer(vocab: list[str]):
    """The Hugging Face tokenizer of `tokenize` (words and punctuation marks, id by rank,
    unknown words -> <unk>), so a saved model can be read by ``aniso report --text-file``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(_TOKEN.pattern), behavior="isolated")]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")


def split_texts(text: str) -> tuple[str, str]:
    """The training and validation texts of `train_valid`'s 90% / 10% split, as words and
    punctuation marks joined by spaces (the tokenizers give them the same ids)."""
    words = _TOKEN.findall(text)
    split = int(len(words) * 0.9)
    return " ".join(words[:split]), " ".join(words[split:])


class Blocks(torch.utils.data.Dataset):
    """Consecutive blocks of `length` ids as ``{"input_ids", "labels"}`` (labels = inputs; the
    model or the callback shifts them)."""

    def __init__(self, ids: torch.Tensor, length: int):
        self.blocks = ids[: len(ids) // length * length].view(-1, length)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def train_valid(path: str | None, vocab_size: int, length: int) -> tuple[Blocks, Blocks, int]:
    """90% / 10% split of the corpus into blocks; returns (train, valid, vocabulary size)."""
    ids, vocab = tokenize(load_text(path), vocab_size)
    split = int(len(ids) * 0.9)
    return Blocks(ids[:split], length), Blocks(ids[split:], length), len(vocab)
