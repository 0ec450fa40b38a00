"""Run by tests/test_lightning.py: `python lightning_dist_script.py single|ddp|fsdp2|tp OUT`.

single: one process, batch size 4; ddp / fsdp2: two CPU processes (gloo), batch size 2 each,
the same global batches (DistributedSampler, no shuffle). AGG + a loss-term plugin + geometry
metrics; each rank writes its counters and logged metrics to OUT/<mode><rank>.json. tp: tensor parallel
size 2 with the LM head in the plan, which the callback refuses before the first step."""

import json
import os
import sys

import lightning.pytorch as pl
import torch

from aniso_plugins import AnisoConfig
from aniso_plugins.integrations.lightning import AnisoCallback
from lightning_utils import LitLM, loader
from third_party_plugin import HeadNormPlugin

mode, out = sys.argv[1], sys.argv[2]


class Record(pl.Callback):
    def __init__(self):
        self.metrics = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.metrics.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("aniso/")})


cfg = AnisoConfig(method="agg", alpha=0.5, window=4, metrics=("geometry",), load_entry_points=False)
cb = AnisoCallback(cfg, [HeadNormPlugin(0.5)], head="model.lm_head", input_embedding="model.embed", blocks="model.blocks", targets="causal")
record = Record()
if mode == "single":
    kw = dict(devices=1)
elif mode == "ddp":
    kw = dict(devices=2, strategy="ddp")
else:
    from lightning.pytorch.strategies import ModelParallelStrategy

    tp = 2 if mode == "tp" else 1
    kw = dict(devices=2, strategy=ModelParallelStrategy(data_parallel_size=2 // tp, tensor_parallel_size=tp))
trainer = pl.Trainer(
    accelerator="cpu", max_steps=3, log_every_n_steps=1, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, callbacks=[cb, record], use_distributed_sampler=False,
    **kw,
)
class Module(LitLM):
    def configure_model(self) -> None:
        if mode != "tp":
            return super().configure_model()
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        parallelize_module(self.model, self.device_mesh["tensor_parallel"], {"lm_head": ColwiseParallel()})

    def train_dataloader(self):  # built after the process group exists: explicit, unshuffled shards
        data = loader(batch_size=4 if mode == "single" else 2)
        if mode == "single":
            return data
        sampler = torch.utils.data.DistributedSampler(data.dataset, shuffle=False)
        return torch.utils.data.DataLoader(data.dataset, batch_size=2, sampler=sampler)


trainer.fit(Module(tied=mode != "tp"))
state = cb.session.plugins.state_dict()
result = {
    "state": {f"{ns}/{k}": v.double().flatten().tolist() for ns, d in state.items() for k, v in d.items()},
    "metrics": record.metrics,
}
with open(os.path.join(out, f"{mode}{trainer.global_rank}.json"), "w") as f:
    json.dump(result, f)
