"""A word-level tokenizer and Zipf-like sentences for the TRL tests (built here, nothing downloaded)."""

from __future__ import annotations

import random

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

WORDS = [f"w{i}" for i in range(40)]
VOCAB = {"<pad>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `WORDS`."""
    model = Tokenizer(models.WordLevel(VOCAB, unk_token="<pad>"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>", eos_token="<eos>")


def texts(n: int = 32, seed: int = 0) -> list[str]:
    """Sentences whose word frequencies fall off (words of small index are common)."""
    rng = random.Random(seed)
    return [" ".join(WORDS[min(int(rng.paretovariate(1.0)) - 1, 39)] for _ in range(rng.randint(4, 12))) for _ in range(n)]
