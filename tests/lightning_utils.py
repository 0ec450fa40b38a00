"""A tiny plain-PyTorch causal LM and LightningModule for the Lightning tests (CPU), and
Lightning's DeepSpeed and FSDP1 strategies on CPU processes (`cpu_strategy`)."""

from __future__ import annotations

from typing import Any

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


STRATEGIES = ("zero1", "zero2", "zero3", "zero3_offload", "fsdp1", "fsdp1_flat")
"""DeepSpeedStrategy with ZeRO stages 1, 2, 3, and 3 with parameters and optimizer states
offloaded to CPU; FSDPStrategy (FSDP1, the blocks wrapped on their own) with
``use_orig_params=True`` (Lightning's default) and False (flat parameters)."""


def cpu_strategy(name: str, fp16_loss_scale: float | None = None) -> pl.strategies.Strategy:
    """Lightning's strategy `name` (`STRATEGIES`) on two gloo CPU processes (test harness only);
    `fp16_loss_scale`: DeepSpeed's fp16 with this static loss scale.

    Lightning and torch refuse both without an accelerator, which users on GPUs never meet:

    - FSDPStrategy: ``Trainer`` raises "The strategy `fsdp` requires a GPU accelerator" where
      ``type(strategy) is FSDPStrategy`` (a subclass passes), and FSDP1 raises "FSDP needs a
      non-CPU accelerator device" unless given ``device_id=cpu`` (Lightning passes the device's
      index, None): the subclass wraps the model as Lightning would, with that device;
    - DeepSpeedStrategy: ``setup_environment`` raises "The DeepSpeed strategy is only supported
      on CUDA GPUs" (the subclass skips that check), and DeepSpeed needs ``DS_ACCELERATOR=cpu``
      and devices indexed by local rank (its ``device_rank``).

    ZeRO-3 leaves parameters under ``stage3_param_persistence_threshold`` gathered: 0 here, so
    that the tiny model is partitioned."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy

    class CPUFSDPStrategy(FSDPStrategy):
        def _setup_model(self, model: nn.Module) -> nn.Module:
            from torch.distributed.fsdp import FullyShardedDataParallel

            return super()._setup_model(FullyShardedDataParallel(
                model, cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"), **self.kwargs,
            ))  # fmt: skip

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)

    if name not in STRATEGIES:
        raise ValueError(f"strategy {name!r}: expected one of {STRATEGIES}")
    if name.startswith("fsdp1"):
        return CPUFSDPStrategy(
            auto_wrap_policy={nn.TransformerEncoderLayer}, process_group_backend="gloo", use_orig_params=name == "fsdp1"
        )
    zero: dict[str, Any] = {"stage": int(name[4])}
    if zero["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if name.endswith("offload"):
        zero |= {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    config = {"zero_optimization": zero, "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
    if fp16_loss_scale is not None:
        from hf_engines import allow_deepspeed_cpu_fp16

        allow_deepspeed_cpu_fp16()
        config["fp16"] = {"enabled": True, "loss_scale": fp16_loss_scale}
    devices = [torch.device("cpu", rank) for rank in range(2)]
    return CPUDeepSpeedStrategy(config=config, parallel_devices=devices, process_group_backend="gloo")
