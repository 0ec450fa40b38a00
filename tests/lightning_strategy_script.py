"""Run by tests/test_lightning_strategies.py:

    python lightning_strategy_script.py MODE OUT.json [--accumulate K] [--lr LR] [--fp16-loss-scale S]

MODE: single (one process, batch size 4) or one of `lightning_utils.STRATEGIES` on two CPU
processes (gloo), batch size 2 each: the same global batches (no shuffle), K micro-batches
per step (1 by default). AGG + a loss-term plugin + geometry and frequency metrics, SGD (lr
0.1 by default). Rank 0 writes OUT.json: the logged ``aniso/...`` values of every step,
every parameter after training (gathered the engine's way), the plugins' counters, and what the
engine did (so that a test cannot pass because nothing was partitioned)."""

import argparse
import json

import lightning.pytorch as pl
import torch

from aniso_plugins import AnisoConfig
from aniso_plugins.integrations.lightning import AnisoCallback
from lightning_utils import LitLM, cpu_strategy, loader
from third_party_plugin import HeadNormPlugin

STEPS = 3

parser = argparse.ArgumentParser()
parser.add_argument("mode")
parser.add_argument("out")
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--fp16-loss-scale", type=float, default=None, help="DeepSpeed fp16 with this static loss scale")
args = parser.parse_args()
single = args.mode == "single"


class Record(pl.Callback):
    """The ``aniso/...`` values Lightning logged at each optimizer step, and after each
    micro-batch the elements of the storage behind the head's weight on this rank (fewer than
    the weight's under ZeRO-3, a placeholder, and FSDP1, a shard or nothing)."""

    def __init__(self):
        self.metrics: dict[int, dict[str, float]] = {}
        self.head_elements: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("aniso/")}
        if logged:
            self.metrics[trainer.global_step] = logged
        weight = pl_module.model.lm_head.weight
        self.head_elements.append(weight.untyped_storage().nbytes() // weight.element_size())


class Module(LitLM):
    def configure_optimizers(self):  # FSDP1 with flat parameters needs those of the wrapped model
        return torch.optim.SGD(self.trainer.model.parameters(), lr=self.lr)

    def train_dataloader(self):  # built after the process group exists: explicit, unshuffled shards
        if single:
            return loader(batch_size=4)
        data = loader(batch_size=2)
        sampler = torch.utils.data.DistributedSampler(data.dataset, shuffle=False)
        return torch.utils.data.DataLoader(data.dataset, batch_size=2, sampler=sampler)


def full_parameters(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, list[float]]:
    """Every parameter as a full tensor (collective: every rank calls it)."""
    if args.mode.startswith("zero"):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {n: p.double().flatten().tolist() for n, p in module.named_parameters()}
    if args.mode.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(trainer.model, writeback=False):
            named = trainer.model.named_parameters()
            return {n.replace("_fsdp_wrapped_module.", ""): p.double().flatten().tolist() for n, p in named}
    return {n: p.double().flatten().tolist() for n, p in module.named_parameters()}


cfg = AnisoConfig(method="agg", alpha=0.5, window=4, metrics=("geometry", "frequency"), load_entry_points=False)
paths = dict(head="model.lm_head", input_embedding="model.embed", blocks="model.blocks", targets="causal")
cb = AnisoCallback(cfg, [HeadNormPlugin(0.5)], **paths)
record = Record()
kw = dict(devices=1) if single else dict(devices=2, strategy=cpu_strategy(args.mode, args.fp16_loss_scale))
trainer = pl.Trainer(
    accelerator="cpu", max_steps=STEPS, accumulate_grad_batches=args.accumulate, log_every_n_steps=1, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[cb, record],
    use_distributed_sampler=False, **kw,
)
module = Module(lr=args.lr)
trainer.fit(module)
weights = full_parameters(trainer, module)
if trainer.is_global_zero:
    counters = cb.session.plugins.state_dict()
    state = {f"{ns}/{k}": v.double().flatten().tolist() for ns, d in counters.items() for k, v in d.items()}
    result = {"metrics": record.metrics, "weights": weights, "state": state, "engine": type(trainer.model).__name__,
              "head_elements": record.head_elements}  # fmt: skip
    if args.mode.startswith("zero"):
        engine = trainer.model
        result["zero_stage"] = engine.zero_optimization_stage()
        result["offloaded"] = engine.zero_offload_param() is not None and engine.zero_cpu_offload()
    with open(args.out, "w") as f:
        json.dump(result, f)
