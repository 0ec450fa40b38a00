"""Run by tests/test_remedies_trainers.py: ``python lightning_remedies_script.py single|fsdp2 OUT METHOD...``.

single: one process, batch size 4; fsdp2: `ModelParallelStrategy` on two CPU processes (gloo),
batch size 2 each, the same global batches (DistributedSampler, no shuffle), the tied head and
embedding one FSDP2 row-sharded parameter. AdamW, 3 steps, the geometry metrics; rank 0 writes
the gathered weights and the logged ``aniso/...`` values to OUT."""

import json
import sys

import lightning.pytorch as pl
import torch

from aniso_plugins import AnisoConfig
from aniso_plugins.integrations.lightning import AnisoCallback
from lightning_utils import LitLM, loader

mode, out, methods = sys.argv[1], sys.argv[2], tuple(sys.argv[3:])


class Record(pl.Callback):
    def __init__(self):
        self.metrics = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.metrics.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("aniso/")})


class Module(LitLM):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.0)

    def train_dataloader(self):
        data = loader(batch_size=4 if mode == "single" else 2)
        if mode == "single":
            return data
        sampler = torch.utils.data.DistributedSampler(data.dataset, shuffle=False)
        return torch.utils.data.DataLoader(data.dataset, batch_size=2, sampler=sampler)


config = AnisoConfig(method=methods, mu_loss_weight=10.0, metrics=("geometry",), load_entry_points=False)
callback = AnisoCallback(config, head="model.lm_head", input_embedding="model.embed", blocks="model.blocks", targets="causal")
record = Record()
if mode == "single":
    kw = dict(devices=1)
else:
    from lightning.pytorch.strategies import ModelParallelStrategy

    kw = dict(devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))
trainer = pl.Trainer(
    accelerator="cpu", max_steps=3, log_every_n_steps=1, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, callbacks=[callback, record], use_distributed_sampler=False, **kw,
)
module = Module()
trainer.fit(module)
sharded = {n: type(p).__name__ for n, p in module.named_parameters()}
weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double().tolist() for n, p in module.named_parameters()}
if trainer.global_rank == 0:
    with open(out, "w") as f:
        json.dump({"weights": weights, "metrics": record.metrics, "types": sharded}, f)
