"""One HF Trainer run on a distributed engine (tests/hf_engines.py), or its 1-process reference.

    torchrun --nproc_per_node 2 hf_engine_script.py OUT ENGINE CONFIG [--resume STEP] [--model MODEL]
             [--save STEP] [--state-dict-type SHARDED_STATE_DICT]
    python hf_engine_script.py OUT single CONFIG            (1 process, the same global batch)

Rank 0 writes OUT/record.json (the log history's losses and ``aniso/...`` values) and
OUT/weights.safetensors (every parameter, gathered the engine's way); with --save STEP it also
checkpoints every STEP steps, and with --resume STEP it resumes from checkpoint-STEP of OUT."""

from __future__ import annotations

import argparse
import json
import os

import torch
from hf_engines import engine_arguments, install_cpu_shims
from hf_utils import TokenDataset, tiny_gpt2, tiny_llama
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from aniso_plugins import AnisoConfig
from aniso_plugins.integrations.hf import AnisoCallback

CONFIGS = {
    "none": dict(metrics=()),
    "agg": dict(method="agg", alpha=0.5, window=2, metrics=("geometry", "frequency")),
    "cosreg": dict(method="cosreg", reg_weight=0.5, metrics=("geometry",)),
    "lowrank": dict(head="lowrank", lowrank_rank=4, metrics=("geometry", "frequency")),
    "agg_untied": dict(method="agg", alpha=0.5, window=2, head="untie", metrics=("geometry", "frequency", "under_trained")),
}

GLOBAL_BATCH, ACCUMULATION, STEPS = 4, 2, 4


def full_weights(trainer: Trainer, engine: str) -> dict[str, torch.Tensor]:
    """Every parameter of the model as a full tensor (collective: every rank calls it)."""
    model = trainer.model
    if engine.startswith("zero"):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    if engine.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(trainer.model_wrapped, writeback=False, rank0_only=False):
            return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in trainer.model_wrapped.named_parameters()}
    out = {}
    for n, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[n] = full.detach().clone()
    return out


def engine_facts(trainer: Trainer, callback: AnisoCallback) -> dict:
    """What the engine really did (a test must not pass because accelerate fell back to DDP, or
    because ZeRO-3 left the tiny model gathered)."""
    head = callback.session.handle.head().weight
    facts = {
        "fsdp": bool(trainer.is_fsdp_enabled),
        "deepspeed": bool(trainer.is_deepspeed_enabled),
        "wrapper": type(trainer.model_wrapped).__name__,
        "head_numel_between_steps": head.numel(),
        "head_shape_between_steps": list(head.shape),
    }
    if trainer.is_deepspeed_enabled:
        facts["zero_stage"] = trainer.model_wrapped.zero_optimization_stage()
    return facts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("engine")
    parser.add_argument("config", choices=sorted(CONFIGS))
    parser.add_argument("--model", default="llama", choices=("llama", "gpt2", "llama_from_config"))
    parser.add_argument("--save", type=int, default=0)
    parser.add_argument("--resume", type=int, default=0)
    parser.add_argument("--state-dict-type", default=None, help="FSDP's checkpoint form (SHARDED_STATE_DICT)")
    a = parser.parse_args()
    single = a.engine == "single"
    world = 1 if single else int(os.environ["WORLD_SIZE"])
    install_cpu_shims()
    engine = {"use_cpu": True} if single else engine_arguments(
        a.engine, layer_cls="LlamaDecoderLayer" if "llama" in a.model else None, state_dict_type=a.state_dict_type)
    args = TrainingArguments(
        output_dir=os.path.join(a.out, "run"), per_device_train_batch_size=GLOBAL_BATCH // world,
        gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS, logging_steps=1, learning_rate=1e-2,
        max_grad_norm=1.0, report_to="none", disable_tqdm=True, seed=0, save_strategy="steps" if a.save else "no",
        save_steps=a.save or 500, save_only_model=False, **engine,
    )
    if a.model == "gpt2":
        model = tiny_gpt2()
    elif a.model == "llama":
        model = tiny_llama()
    else:  # built after TrainingArguments: under ZeRO-3 transformers builds it partitioned (zero.Init)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_llama().config)
    callback = AnisoCallback(AnisoConfig(load_entry_points=False, **CONFIGS[a.config]))
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(n=64), callbacks=[callback])
    resume = os.path.join(a.out, "run", f"checkpoint-{a.resume}") if a.resume else None
    trainer.train(resume_from_checkpoint=resume)
    weights = full_weights(trainer, a.engine)
    facts = engine_facts(trainer, callback)
    if trainer.is_world_process_zero():
        records = [
            {k: v for k, v in r.items() if k in ("loss", "step") or k.startswith("aniso/")}
            for r in trainer.state.log_history
            if "loss" in r
        ]
        suffix = f"_resumed{a.resume}" if a.resume else ""
        with open(os.path.join(a.out, f"record{suffix}.json"), "w") as f:
            json.dump({"records": records, "world": world, "engine": facts}, f)
        save_file({n: w.contiguous() for n, w in weights.items()}, os.path.join(a.out, f"weights{suffix}.safetensors"))


if __name__ == "__main__":
    main()
