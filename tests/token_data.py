"""Random token sequences shared by the trainer tests."""

from __future__ import annotations

import torch

VOCAB = 64


class TokenDataset(torch.utils.data.Dataset):
    """Random token sequences with a Zipf-like distribution (so some tokens are rare);
    labels = input_ids (the model shifts)."""

    def __init__(self, n: int = 32, length: int = 8, vocab: int = VOCAB, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        p = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
        self.ids = torch.multinomial(p / p.sum(), n * length, replacement=True, generator=g).view(n, length)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
