"""TRL's SFTTrainer step with aniso_plugins' head methods against the plain SFTTrainer
(docs/performance.md §13): TRL's chunked loss kept, or given up for the head's logits.

    python benchmarks/trl_step.py             # GPT-2 d=128, 2 layers, V=151936 (Qwen's), 4×512 tokens per step, fp32 CPU
    python benchmarks/trl_step.py --vocab 50257
    python benchmarks/trl_step.py --smoke     # tiny sizes (the test suite)

Variants, each a real ``trl.SFTTrainer`` with TRL's defaults (its fused LM head: log-probabilities
in vocabulary tiles of 32768 ids, never the logits; AdamW, no clipping) on the same seeded model
and Zipf(1.2) token ids: ``plain`` (no callback), ``agg`` (``method="agg"``: the head answers
TRL's fused call chunk by chunk, AGG-gated), ``cosreg`` (``method="cosreg"``: the same chunked
call, plus the regularizer), ``agg_logits`` (``method="agg", fused_loss=False``: TRL's call
computed from the head's full logits, the route before issue 50).

- time: one process; ``--rounds`` rounds each train every variant for ``--steps`` optimizer steps
  after one warm-up step in the same trainer; the table gives each variant's median step time and
  the median over rounds of its ratio to ``plain`` of the same round;
- memory: each variant in a fresh process: the peak resident memory during ``train()`` of two
  steps above what the process held after building the model, the data and the trainer
  (`measure.PeakMemory`).

The target of issue 50: ``agg`` ≤ 1.0× plain's peak at ≤ 1.05× its time.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
sys.path.insert(0, HERE)

from trainer_steps import compare_variants, gpt2, memory_worker, step_times  # noqa: E402

VARIANTS = {
    "plain": None,
    "agg": dict(method="agg"),
    "cosreg": dict(method="cosreg", reg_weight=0.1),
    "agg_logits": dict(method="agg", fused_loss=False),
}
SIZES = {"full": (128, 2, 151936, 4, 512), "smoke": (32, 1, 1000, 2, 32)}  # dim, layers, vocab, batch, length


def _data(n: int, length: int, vocab: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)
    p = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-1.2)
    ids = torch.multinomial(p / p.sum(), n * length, replacement=True, generator=g).view(n, length)
    return Dataset.from_dict({"input_ids": ids.tolist()})


def _trainer(args, variant: str, steps: int, out: str):
    import trl

    from aniso_plugins import AnisoConfig
    from aniso_plugins.integrations.hf import AnisoCallback

    sys.path.insert(0, TESTS)
    from word_data import tokenizer  # the pad and eos ids only: the data is token ids already

    fields = VARIANTS[variant]
    config = None if fields is None else AnisoConfig(metrics=(), window=100, load_entry_points=False, **fields)
    times = step_times()
    trainer = trl.SFTTrainer(
        model=gpt2(args),
        args=trl.SFTConfig(output_dir=out, per_device_train_batch_size=args.batch, max_steps=steps, report_to="none",
                           disable_tqdm=True, save_strategy="no", logging_strategy="no", max_grad_norm=0.0, seed=0,
                           use_cpu=True, bf16=False, max_length=args.length, dataloader_num_workers=0),
        train_dataset=_data(args.batch * steps, args.length, args.vocab),
        processing_class=tokenizer(),
        callbacks=([] if config is None else [AnisoCallback(config)]) + [times],
    )
    return trainer, times


def _size_flags(args) -> list[str]:
    return [f"--{name}={getattr(args, name)}" for name in ("dim", "layers", "vocab", "batch", "length")] + [
        f"--out={args.out}"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, help="default 128")
    p.add_argument("--layers", type=int, help="default 2")
    p.add_argument("--vocab", type=int, help="default 151936")
    p.add_argument("--batch", type=int, help="sequences per step; default 4")
    p.add_argument("--length", type=int, help="default 512")
    p.add_argument("--steps", type=int, default=2, help="timed optimizer steps per round (after one warm-up step)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default="/tmp/aniso-trl-step")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name, value in zip(("dim", "layers", "vocab", "batch", "length"), SIZES["smoke" if args.smoke else "full"]):
        if getattr(args, name) is None or args.smoke:
            setattr(args, name, value)
    if args.smoke:
        args.steps, args.rounds = 1, 1
    if args.worker:
        memory_worker(_trainer(args, args.worker, 2, os.path.join(args.out, f"mem-{args.worker}"))[0], args.worker)
        return
    compare_variants(os.path.abspath(__file__), args, VARIANTS, lambda v, steps, out: _trainer(args, v, steps, out),
                     _size_flags(args), "TRL SFTTrainer step")


if __name__ == "__main__":
    main()
