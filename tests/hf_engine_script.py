"""HF Trainer runs on a distributed engine (tests/hf_engines.py), or their 1-process reference.

    torchrun --nproc_per_node 2 hf_engine_script.py OUT ENGINE RUN[,RUN...] [--save STEP | --resume STEP] [--save-model]
    python hf_engine_script.py OUT single RUN[,RUN...]      (1 process, the same global batch)

Each optimizer step trains on GLOBAL_BATCH × ACCUMULATION sequences, as ``--accumulation`` (default
ACCUMULATION) micro-batches on each rank.

A RUN is ``[TRAINER:]CONFIG``: the `transformers.Trainer` on a tiny Llama (default),
``seq2seq:`` `Seq2SeqTrainer` on a tiny Marian, ``sft:`` TRL's `SFTTrainer` on a tiny Llama and
text, each with one of `CONFIGS`; the runs go one after the other in the same processes. Rank 0
writes OUT/RUN/record.json (the log history's losses and ``aniso/...`` values, and what the engine
did) and OUT/RUN/weights.safetensors (every parameter after training, gathered the engine's way),
":" written "_"; with --save STEP each run checkpoints every STEP steps, with --resume STEP it
resumes from its checkpoint-STEP (files suffixed ``_resumedSTEP``); with --save-model,
``trainer.save_model(OUT/RUN/saved)`` after training (under ZeRO-3 with
``stage3_gather_16bit_weights_on_model_save``, without which the Trainer writes no model file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from hf_engines import allow_deepspeed_cpu_fp16, engine_arguments, install_cpu_shims
from hf_utils import VOCAB, TokenDataset, tiny_gpt2, tiny_llama
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

from aniso_plugins import AnisoConfig
from aniso_plugins.integrations.hf import AnisoCallback

CONFIGS = {
    "none": dict(metrics=()),
    "agg": dict(method="agg", alpha=2, window=2, metrics=("geometry", "frequency")),
    "cosreg": dict(method="cosreg", reg_weight=0.5, metrics=("geometry",)),
    "lowrank": dict(head="lowrank", lowrank_rank=4, metrics=("geometry", "frequency")),
    "agg_lowrank": dict(method="agg", alpha=2, window=2, head="lowrank", lowrank_rank=4, metrics=("geometry",)),
    "agg_untied": dict(method="agg", alpha=2, window=2, head="untie", metrics=("geometry", "frequency", "under_trained")),
    "activations": dict(
        method=("agg", "simctg", "uniformity"), alpha=2, window=2, simctg_weight=0.5, uniformity_weight=0.1,
        metrics=("hidden", "bottleneck", "uniformity", "eval"), report_at_end=True,
    ),
    "coupled_centering": dict(method=("coupled_adam", "mu_centering"), metrics=("geometry",)),
    "mu_loss": dict(method="mu_loss", mu_loss_weight=10.0, metrics=("geometry",)),
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
    facts = {
        "fsdp": bool(trainer.is_fsdp_enabled),
        "deepspeed": bool(trainer.is_deepspeed_enabled),
        "wrapper": type(trainer.model_wrapped).__name__,
        "head_shapes_between_steps": [list(p.shape) for p in callback.session.handle.head().parameters(recurse=False)],
    }
    if trainer.is_deepspeed_enabled:
        facts["zero_stage"] = trainer.model_wrapped.zero_optimization_stage()
    return facts


class StartStep(TrainerCallback):
    """The step training starts from (the checkpoint's on a resume)."""

    step: int | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.step = state.global_step


def causal_lm(kind: str, out: str) -> torch.nn.Module:
    if kind == "gpt2":
        return tiny_gpt2()
    if kind == "llama" or not torch.distributed.is_initialized():
        return tiny_llama()
    # "llama_pretrained": tiny_llama's weights saved, then loaded after TrainingArguments, as users
    # load a model: under ZeRO-3 transformers builds it partitioned (deepspeed.zero.Init)
    path = os.path.join(out, "pretrained")
    if torch.distributed.get_rank() == 0:
        tiny_llama().save_pretrained(path)
    torch.distributed.barrier()
    return AutoModelForCausalLM.from_pretrained(path)


def tiny_marian() -> torch.nn.Module:
    from transformers import MarianConfig, MarianMTModel

    torch.manual_seed(0)
    return MarianMTModel(MarianConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    ))  # fmt: skip


class Pairs(torch.utils.data.Dataset):
    """Source and target ids of the Zipf-like `TokenDataset` (targets of another length)."""

    def __init__(self, n: int, seed: int = 0):
        self.src, self.tgt = TokenDataset(n, 7, seed=seed).ids, TokenDataset(n, 5, seed=seed + 100).ids

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.src[i], "attention_mask": torch.ones(7, dtype=torch.long), "labels": self.tgt[i]}


def train(a: argparse.Namespace, run: str, world: int) -> None:
    """One run, ``[TRAINER:]CONFIG`` (TRAINER: trainer, seq2seq or sft); rank 0 writes its record
    and weights into OUT/RUN (":" as "_")."""
    kind, _, name = run.rpartition(":")
    kind = kind or "trainer"
    out = os.path.join(a.out, run.replace(":", "_"))
    layer = {"seq2seq": "MarianDecoderLayer", "sft": "LlamaDecoderLayer"}.get(kind, "LlamaDecoderLayer" if "llama" in a.model else None)
    engine = {"use_cpu": True} if world == 1 else engine_arguments(a.engine, layer_cls=layer)
    if a.save_model and "deepspeed" in engine:
        engine["deepspeed"]["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    args = TrainingArguments(
        output_dir=os.path.join(out, "run"), per_device_train_batch_size=GLOBAL_BATCH * ACCUMULATION // (world * a.accumulation),
        per_device_eval_batch_size=GLOBAL_BATCH // world, gradient_accumulation_steps=a.accumulation, max_steps=STEPS,
        logging_steps=1, learning_rate=1e-2, max_grad_norm=1.0, report_to="none", disable_tqdm=True, seed=0,
        save_strategy="steps" if a.save else "no", save_steps=a.save or 500, optim=a.optim, **engine,
    )
    callback = AnisoCallback(AnisoConfig(load_entry_points=False, **CONFIGS[name]))
    start = StartStep()
    if kind == "sft":
        import trl
        from datasets import Dataset
        from word_data import VOCAB, texts, tokenizer

        args = trl.SFTConfig(**{**args.to_dict(), "max_length": 32, "dataset_text_field": "text", **engine})
        trainer = trl.SFTTrainer(
            model=tiny_llama(vocab=len(VOCAB), tied=False), args=args, train_dataset=Dataset.from_dict({"text": texts(64)}),
            eval_dataset=Dataset.from_dict({"text": texts(8, seed=1)}), processing_class=tokenizer(), callbacks=[callback, start],
        )
    elif kind == "seq2seq":
        from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

        args = Seq2SeqTrainingArguments(**{**args.to_dict(), **engine})
        trainer = Seq2SeqTrainer(
            model=tiny_marian(), args=args, train_dataset=Pairs(64), eval_dataset=Pairs(8, seed=1), callbacks=[callback, start]
        )
    else:
        trainer = Trainer(
            model=causal_lm(a.model, out), args=args, train_dataset=TokenDataset(n=64), eval_dataset=TokenDataset(n=8, seed=1),
            callbacks=[callback, start],
        )
    resume = os.path.join(out, "run", f"checkpoint-{a.resume}") if a.resume else None
    trainer.train(resume_from_checkpoint=resume)
    if "eval" in CONFIGS[name]["metrics"]:
        trainer.evaluate()
    if a.save_model:
        trainer.save_model(os.path.join(out, "saved" + (f"_resumed{a.resume}" if a.resume else "")))
    weights = full_weights(trainer, a.engine)
    facts = engine_facts(trainer, callback)
    facts["start_step"] = start.step
    if trainer.is_world_process_zero():
        records = [
            {k: v for k, v in r.items() if k in ("loss", "eval_loss", "step") or "aniso/" in k}
            for r in trainer.state.log_history
            if "loss" in r or "eval_loss" in r
        ]
        suffix = f"_resumed{a.resume}" if a.resume else ""
        with open(os.path.join(out, f"record{suffix}.json"), "w") as f:
            json.dump({"records": records, "world": world, "engine": facts}, f)
        save_file({n: w.contiguous() for n, w in weights.items()}, os.path.join(out, f"weights{suffix}.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("engine")
    parser.add_argument("runs", help=f"comma-separated [TRAINER:]CONFIG, TRAINER of trainer, seq2seq, sft; CONFIG of {sorted(CONFIGS)}")
    parser.add_argument("--model", default="llama", choices=("llama", "gpt2", "llama_pretrained"))
    parser.add_argument("--save", type=int, default=0)
    parser.add_argument("--optim", default="adamw_torch", help="the TrainingArguments optim")
    parser.add_argument("--resume", type=int, default=0)
    parser.add_argument("--accumulation", type=int, default=ACCUMULATION,
                        help=f"micro-batches per step (the step's {GLOBAL_BATCH * ACCUMULATION} sequences split over them and the ranks)")
    parser.add_argument("--save-model", action="store_true", help="trainer.save_model(OUT/RUN/saved) after training")
    a = parser.parse_args()
    world = 1 if a.engine == "single" else int(os.environ["WORLD_SIZE"])
    install_cpu_shims()
    if a.engine.endswith("_fp16"):
        allow_deepspeed_cpu_fp16()
    for run in a.runs.split(","):
        train(a, run, world)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    # Skip the interpreter's teardown: torch's C++ thread pools can abort at exit
    # ("terminate called without an active exception") after the work is done and written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
