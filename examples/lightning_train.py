"""Train a tiny causal transformer with Lightning and one AnisoCallback, offline.

    python examples/lightning_train.py --method agg     # or mle, cosreg, hinge, spectrum, lowrank
    python examples/lightning_train.py --text-file my.txt

Mirrors examples/hf_train.py (same corpus, vocabulary, methods and final table) with a plain
PyTorch model, so it shows the callback's knobs for models without the transformers API:
``head=``, ``input_embedding=`` and ``blocks=`` name the submodules.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from comparison import METHODS, add_run_arguments, print_table
from corpus import train_valid
from torch import nn

from aniso_plugins import AnisoConfig
from aniso_plugins.integrations.lightning import AnisoCallback


class CausalLM(nn.Module):
    """Token + position embeddings, pre-norm causal self-attention blocks, tied LM head."""

    def __init__(self, vocab: int, dim: int, layers: int, length: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(length, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.1, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight
        # GPT-2's initialisation, N(0, 0.02²) for every weight: with nn.Embedding's default N(0, 1)
        # the tied rows start at norm ~√d and training barely moves them off their random (isotropic)
        # directions, so plain MLE would show no degeneration at all in 400 steps
        for name, p in self.named_parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.position(torch.arange(ids.shape[1], device=ids.device))
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.lm_head(self.norm(h))


class LitCausalLM(pl.LightningModule):
    def __init__(self, vocab: int, dim: int, layers: int, length: int, lr: float, steps: int):
        super().__init__()
        self.model = CausalLM(vocab, dim, layers, length)
        self.lr, self.steps = lr, steps

    def _loss(self, batch) -> torch.Tensor:
        logits = self.model(batch["input_ids"])
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.lr, total_steps=self.steps, pct_start=0.1)
        return [opt], [{"scheduler": sched, "interval": "step"}]


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", choices=sorted(METHODS), default="agg")
    p.add_argument("--text-file", default=None)
    add_run_arguments(p)
    a = p.parse_args(argv)

    pl.seed_everything(a.seed, verbose=False)
    train_ds, valid_ds, vocab = train_valid(a.text_file, a.vocab_size, a.block)
    train = torch.utils.data.DataLoader(train_ds, batch_size=a.batch_size, shuffle=True)
    valid = torch.utils.data.DataLoader(valid_ds, batch_size=a.batch_size)
    # AGG's window K defaults to one epoch of optimizer steps, which the callback reads off the Trainer
    config = AnisoConfig(**METHODS[a.method], metrics=("geometry", "frequency", "eval", "uniformity"))
    callback = AnisoCallback(
        config, head="model.lm_head", input_embedding="model.embed", blocks="model.blocks", targets="causal"
    )
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=a.steps, callbacks=[callback], logger=False, enable_checkpointing=False,
        log_every_n_steps=max(1, a.steps // 8), check_val_every_n_epoch=None, val_check_interval=a.steps,
        num_sanity_val_steps=0, enable_model_summary=False,
    )
    module = LitCausalLM(vocab, a.d_model, a.layers, a.block, lr=3e-3, steps=a.steps)
    trainer.fit(module, train, valid)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    print_table(f"{a.method}: vocabulary {vocab}, {len(train_ds) * a.block} training tokens", metrics, "val_")
    return metrics


if __name__ == "__main__":
    main()
