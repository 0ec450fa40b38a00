"""A tiny plain-PyTorch causal LM and LightningModule for the Lightning tests (CPU)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from token_data import VOCAB, TokenDataset

DIM, LENGTH = 16, 8


class TinyLM(nn.Module):
    """Embedding -> causal self-attention blocks -> LM head (tied to the embedding)."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, layers: int = 1, tied: bool = True):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.0, batch_first=True) for _ in range(layers)
        )
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.lm_head(h)


class LitLM(pl.LightningModule):
    """Next-token cross-entropy, mean over tokens; SGD; FSDP2 in configure_model under
    ModelParallelStrategy."""

    def __init__(self, seed: int = 0, lr: float = 0.1, tied: bool = True):
        super().__init__()
        torch.manual_seed(seed)
        self.model = TinyLM(tied=tied)
        self.lr = lr

    def configure_model(self) -> None:
        if getattr(self, "device_mesh", None) is not None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)  # embedding and tied head in one group

    def _loss(self, batch):
        logits = self.model(batch["input_ids"])
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, batch_size=len(batch["input_ids"]))
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), batch_size=len(batch["input_ids"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def loader(n: int = 32, batch_size: int = 4, seed: int = 0) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(TokenDataset(n=n, length=LENGTH, vocab=VOCAB, seed=seed), batch_size=batch_size)


class GradCapture(pl.Callback):
    """Gradients right before each optimizer step (after unscaling, before clipping)."""

    def __init__(self):
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append(
            {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
             for n, p in pl_module.named_parameters() if p.grad is not None}
        )
