"""One HF Trainer training step with and without the fused loss (docs/performance.md §8), and on
the Trainer's distributed engines with AGG and its metrics (§8.1).

    python benchmarks/hf_step.py                 # GPT-2 d=256, 2 layers, V=50257, 8×512 tokens per step, fp32 CPU
    python benchmarks/hf_step.py --smoke         # tiny sizes (the test suite)
    python benchmarks/hf_step.py --engine ddp,fsdp2,zero2,zero3      # 2 processes per engine
    python benchmarks/hf_step.py --engine ddp,fsdp2,zero2,zero3 --smoke

Variants, each a real `transformers.Trainer` (AdamW, no clipping) on the same seeded model and
Zipf(1.2) token ids: ``plain`` (no callback: the model's own loss from the full logits),
``mle_fused`` (``AnisoConfig(fused_loss=True)``: the same loss from the fused chunked
cross-entropy), ``agg_fused`` (``method="agg"``: fused by default), ``agg_gated`` (``method="agg",
fused_loss=False``: the gated head, full logits); and the other remedies of docs/results.md §9
(``cosreg``, ``hinge``, ``spectrum``, ``untie``, ``lowrank``, ``coupled_adam``, ``mu_centering``,
``mu_loss``) for ``--variants``.

- time: one process; ``--rounds`` rounds each train every variant for ``--steps`` optimizer steps
  (after one warm-up step in the same Trainer); a step is the wall time from the Trainer's
  ``on_step_begin`` to its ``on_step_end`` (forward, backward, optimizer); the table gives each
  variant's median step time and the median over rounds of its ratio to ``plain`` of the same
  round;
- memory: each variant in a fresh process: the peak resident memory during ``train()`` of two
  steps above what the process held after building the model, the data and the Trainer
  (`measure.PeakMemory`).

The target of issue 25: fused rows ≤ 0.5× plain's peak at ≤ 1.0× its time.

``--engine E[,E...]`` (any of ``tests/hf_engines.py``'s ``ENGINES``: ddp, fsdp1, fsdp2, zero1-3,
...; default none: the 1-process table above): for each engine, ``plain`` (no callback) against
``agg_metrics`` (``AnisoConfig(method="agg", metrics=("geometry", "frequency"),
metrics_every=1)``: the fused AGG loss, and both metrics measured after every optimizer step, so
that their cost is inside the timed step), both on ``--nproc`` (2) processes started with
``python -m torch.distributed.run --standalone``, one engine at a time; ``--variants`` does not
apply. Default sizes of this mode: GPT-2 d=128, 2 layers, V=16384, 4×256 tokens per rank and
step (8×256 per optimizer step on 2 ranks), fp32; with ``--smoke`` d=32, 1 layer, V=1000, 2×32
tokens per rank, 1 round of 1 step (seconds per engine, the numbers meaningless). Per rank:

- time: the protocol above (the same callback, each rank timing its own steps), in the processes
  of the first launch after its memory run; ``--rounds`` rounds alternate the two variants'
  order;
- memory: each variant in a fresh launch (``--smoke``: both in the one launch), the peak during
  ``train()`` of two steps per rank (`measure.PeakMemory`: resident memory on the CPU, CUDA's
  allocated peak on a GPU).

The table: engine | rank | step times (ms) | median per-round time ratio agg/plain | peaks (MiB) |
memory ratio; the JSON of the numbers is printed and written to ``--out``/hf_step_engines.json.

On the CPU the ranks are gloo processes (1 torch thread each unless ``--threads``) with
``DS_ACCELERATOR=cpu``, and each process installs ``tests/hf_engines.py``'s
``install_cpu_shims()``: two small accelerate patches without which FSDP silently trains DDP and
DeepSpeed does not start on CPU processes. They exist for CPU runs only: where
``torch.cuda.is_available()`` the same engines run without them (nor ``DS_ACCELERATOR``), on NCCL,
one process per GPU (set ``--nproc`` to the number of GPUs), with the step times synchronized.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
sys.path.insert(0, HERE)

from measure import PeakMemory  # noqa: E402
from trainer_steps import compare_variants, gpt2, memory_worker, step_times  # noqa: E402

VARIANTS = {
    "plain": None,
    "mle_fused": dict(fused_loss=True),
    "agg_fused": dict(method="agg"),
    "agg_gated": dict(method="agg", fused_loss=False),
    # the remedies of docs/results.md §9 (``--variants plain,agg_fused,cosreg,...``)
    "cosreg": dict(method="cosreg"),
    "hinge": dict(method="hinge", hinge_sample=256),
    "spectrum": dict(method="spectrum", reg_weight=0.1),
    "untie": dict(head="untie"),
    "lowrank": dict(head="lowrank", lowrank_rank=16),
    "coupled_adam": dict(method="coupled_adam"),
    "mu_centering": dict(method="mu_centering"),
    "mu_loss": dict(method="mu_loss"),
}

ENGINE_VARIANTS = {
    "plain": None,
    "agg_metrics": dict(method="agg", metrics=("geometry", "frequency"), metrics_every=1),
}
"""The two variants of ``--engine`` (each complete: no ``window``/``metrics`` defaults of `VARIANTS`)."""

SIZES = {  # dim, layers, vocab, batch (per rank with --engine), length
    "single": (256, 2, 50257, 8, 512),
    "engine": (128, 2, 16384, 4, 256),
    "smoke": (32, 1, 1000, 2, 32),
}


class _Ids(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1)
        p = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-1.2)
        self.ids = torch.multinomial(p / p.sum(), n * length, replacement=True, generator=g).view(n, length)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _engine_arguments(engine: str, cuda: bool) -> dict:
    """TrainingArguments keywords of `engine` (tests/hf_engines.py); on GPUs without the CPU ones
    (``use_cpu``, the gloo backend)."""
    from hf_engines import engine_arguments

    kwargs = engine_arguments(engine, layer_cls="GPT2Block")
    if cuda:
        kwargs.pop("use_cpu", None)
        kwargs.pop("ddp_backend", None)
    return kwargs


def _trainer(args, variant: str, steps: int, out: str, engine: str | None = None, world: int = 1):
    from transformers import Trainer, TrainingArguments

    from aniso_plugins import AnisoConfig
    from aniso_plugins.integrations.hf import AnisoCallback

    cuda = engine is not None and torch.cuda.is_available()

    if engine is None:
        fields = VARIANTS[variant]
        config = None if fields is None else AnisoConfig(metrics=(), window=100, load_entry_points=False, **fields)
        placement = {"use_cpu": True}
    else:
        fields = ENGINE_VARIANTS[variant]
        config = None if fields is None else AnisoConfig(load_entry_points=False, **fields)
        placement = _engine_arguments(engine, cuda)
    callbacks = [] if config is None else [AnisoCallback(config)]
    times = step_times(cuda)  # after the AnisoCallback: its on_step_end (metrics) is inside the step
    trainer = Trainer(
        model=gpt2(args),
        args=TrainingArguments(output_dir=out, per_device_train_batch_size=args.batch, max_steps=steps,
                               report_to="none", disable_tqdm=True, save_strategy="no", logging_strategy="no",
                               max_grad_norm=0.0, seed=0, dataloader_num_workers=0, **placement),
        train_dataset=_Ids(args.batch * world * steps, args.length, args.vocab),
        callbacks=[*callbacks, times],
    )
    return trainer, times


def _size_flags(args) -> list[str]:
    return ["--dim", str(args.dim), "--layers", str(args.layers), "--vocab", str(args.vocab), "--batch", str(args.batch),
            "--length", str(args.length), "--out", args.out, "--threads", str(args.threads)]


# --- --engine: one torchrun launch per engine and phase list -----------------------------------------------------


def _prepare_rank_process() -> bool:
    """Install tests/hf_engines.py's accelerate shims in this rank's process where there is no GPU
    (CPU runs only: a GPU run uses accelerate as it is); returns whether they were installed."""
    sys.path.insert(0, TESTS)  # tests/hf_engines.py: the engines' TrainingArguments, and the shims
    if torch.cuda.is_available():
        return False
    from hf_engines import install_cpu_shims

    install_cpu_shims()
    return True


def _rank_worker(args) -> None:
    """One rank of a launch: runs ``--phases`` (``memory:VARIANT``, ``time``) in order on engine
    ``--rank-worker`` and writes its numbers to OUT/ENGINE/LAUNCH-rankR.json."""
    shims, cuda = _prepare_rank_process(), torch.cuda.is_available()
    engine, rank, world = args.rank_worker, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    out = os.path.join(args.out, engine)
    result = {"rank": rank, "world": world, "threads": torch.get_num_threads(), "device": str(device), "shims": shims,
              "peak_bytes": {}, "seconds": {v: [] for v in ENGINE_VARIANTS}}  # fmt: skip
    variants = list(ENGINE_VARIANTS)
    for phase in args.phases.split(","):
        if phase.startswith("memory:"):
            variant = phase.split(":", 1)[1]
            trainer, _ = _trainer(args, variant, 2, os.path.join(out, f"mem-{variant}"), engine, world)
            with PeakMemory(device) as peak:
                trainer.train()
            result["peak_bytes"][variant] = peak.bytes
        elif phase == "time":
            for r in range(args.rounds):
                for variant in variants if r % 2 == 0 else variants[::-1]:
                    path = os.path.join(out, f"time-{variant}")
                    trainer, times = _trainer(args, variant, 1 + args.steps, path, engine, world)
                    trainer.train()
                    result["seconds"][variant].append(statistics.median(times.seconds[1:]))  # after the warm-up step
                    del trainer, times
                    gc.collect()
        else:
            raise SystemExit(f"unknown phase {phase!r}")
        trainer = None
        gc.collect()
    with open(os.path.join(out, f"{args.launch}-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    # as tests/hf_engine_script.py: skip the interpreter's teardown (torch's thread pools can abort at exit)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _launch(args, engine: str, launch: str, phases: str, env: dict) -> tuple[list[dict] | None, str, float]:
    """One ``torch.distributed.run`` of ``--nproc`` ranks; (their results or None, the error, seconds)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
           os.path.abspath(__file__), "--rank-worker", engine, "--launch", launch, "--phases", phases,
           "--steps", str(args.steps), "--rounds", str(args.rounds), *_size_flags(args)]  # fmt: skip
    for rank in range(args.nproc):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(args.out, engine, f"{launch}-rank{rank}.json"))
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    seconds = time.perf_counter() - start
    paths = [os.path.join(args.out, engine, f"{launch}-rank{rank}.json") for rank in range(args.nproc)]
    if done.returncode != 0 or not all(os.path.exists(p) for p in paths):
        lines = [x for x in (done.stderr + done.stdout).splitlines() if x.strip()]
        errors = [x for x in lines if ("Error" in x or "error:" in x) and "ChildFailedError" not in x]  # a rank's own
        return None, (errors[-1] if errors else "\n".join(lines[-5:]))[-600:] + f" (exit {done.returncode})", seconds
    results = []
    for p in paths:
        with open(p) as f:
            results.append(json.load(f))
    return results, "", seconds


def _engines(args, engines: list[str]) -> None:
    cuda = torch.cuda.is_available()
    env = dict(os.environ)
    if not cuda:
        env["DS_ACCELERATOR"] = "cpu"
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    if args.smoke:  # one launch: the agg peak is not in a fresh process (smoke numbers are not measurements)
        launches = [("all", "memory:plain,memory:agg_metrics,time")]
    else:
        launches = [("plain", "memory:plain,time"), ("agg", "memory:agg_metrics")]
    numbers: dict[str, dict] = {}
    failed: dict[str, str] = {}
    threads = None
    for engine in engines:
        os.makedirs(os.path.join(args.out, engine), exist_ok=True)
        ranks: list[dict] = [{} for _ in range(args.nproc)]
        for launch, phases in launches:
            results, error, seconds = _launch(args, engine, launch, phases, env)
            status = f" FAILED: {error}" if error else ""
            print(f"[hf_step] {engine} launch {launch} ({phases}): {seconds:.1f} s{status}", file=sys.stderr, flush=True)
            if results is None:
                failed[engine] = error
                break
            for rank, result in enumerate(results):
                threads = result["threads"]
                ranks[rank].setdefault("seconds", {}).update({k: v for k, v in result["seconds"].items() if v})
                ranks[rank].setdefault("peak_bytes", {}).update(result["peak_bytes"])
        if engine in failed:
            continue
        numbers[engine] = {}
        for rank, r in enumerate(ranks):
            plain, agg = r["seconds"]["plain"], r["seconds"]["agg_metrics"]
            peaks = r["peak_bytes"]
            numbers[engine][str(rank)] = {
                "plain_seconds": statistics.median(plain),
                "agg_metrics_seconds": statistics.median(agg),
                "time_ratio": statistics.median(a / p for a, p in zip(agg, plain)),
                "plain_peak_bytes": peaks["plain"],
                "agg_metrics_peak_bytes": peaks["agg_metrics"],
                "memory_ratio": peaks["agg_metrics"] / max(peaks["plain"], 1),
                "rounds_seconds": r["seconds"],
            }
    where = "NCCL, GPU" if cuda else f"gloo CPU, {threads or '?'} thread(s) per rank"
    print(f"HF Trainer step per engine, {args.nproc} processes ({where}), GPT-2 d={args.dim}, {args.layers} layers, "
          f"V={args.vocab}, {args.batch}×{args.length} tokens per rank and step, fp32; plain (no callback) against "
          f"AGG + geometry + frequency metrics every step; median of {args.rounds} rounds × {args.steps} steps")  # fmt: skip
    print("| engine | rank | plain step (ms) | agg+metrics step (ms) | time ratio | plain peak (MiB) | agg peak (MiB) "
          "| memory ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for engine in engines:
        if engine in failed:
            print(f"| {engine} | - | failed: {failed[engine].splitlines()[-1][:200]} | | | | | |")
            continue
        for rank, n in numbers[engine].items():
            print(f"| {engine} | {rank} | {1e3 * n['plain_seconds']:.0f} | {1e3 * n['agg_metrics_seconds']:.0f} | "
                  f"{n['time_ratio']:.3f} | {n['plain_peak_bytes'] / 2**20:.0f} | "
                  f"{n['agg_metrics_peak_bytes'] / 2**20:.0f} | {n['memory_ratio']:.3f} |")
    sizes = {k: getattr(args, k) for k in ("dim", "layers", "vocab", "batch", "length")}
    record = {"engines": numbers, "failed": failed, "sizes": sizes, "nproc": args.nproc, "rounds": args.rounds,
              "steps": args.steps, "threads_per_rank": threads, "cuda": cuda}
    with open(os.path.join(args.out, "hf_step_engines.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(record))
    if failed:
        raise SystemExit(f"engines failed: {', '.join(failed)}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, help="default 256; 128 with --engine")
    p.add_argument("--layers", type=int, help="default 2")
    p.add_argument("--vocab", type=int, help="default 50257; 16384 with --engine")
    p.add_argument("--batch", type=int, help="sequences per step (per rank with --engine); default 8; 4 with --engine")
    p.add_argument("--length", type=int, help="default 512; 256 with --engine")
    p.add_argument("--steps", type=int, default=2, help="timed optimizer steps per round (after one warm-up step)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default="plain,mle_fused,agg_fused,agg_gated", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--engine", default="", help="comma-separated distributed engines (tests/hf_engines.py ENGINES); "
                   "default none: the 1-process variants")  # fmt: skip
    p.add_argument("--nproc", type=int, default=2, help="processes per engine (--engine)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (per rank with --engine); 0: torch's default (1 per rank under torchrun)")
    p.add_argument("--out", default="/tmp/aniso-hf-step")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--rank-worker", help=argparse.SUPPRESS)
    p.add_argument("--launch", help=argparse.SUPPRESS)
    p.add_argument("--phases", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    mode = "smoke" if args.smoke else "engine" if args.engine or args.rank_worker else "single"
    for name, value in zip(("dim", "layers", "vocab", "batch", "length"), SIZES[mode]):
        if getattr(args, name) is None or args.smoke:
            setattr(args, name, value)
    if args.smoke:
        args.steps, args.rounds = 1, 1
    if args.worker:
        memory_worker(_trainer(args, args.worker, 2, os.path.join(args.out, f"mem-{args.worker}"))[0], args.worker)
        return
    if args.rank_worker:
        _rank_worker(args)
        return
    if args.engine:
        sys.path.insert(0, TESTS)
        from hf_engines import ENGINES

        engines = [e for e in args.engine.split(",") if e]
        unknown = [e for e in engines if e not in ENGINES]
        if unknown or not engines:
            raise SystemExit(f"--engine {args.engine!r}: expected a comma-separated list of {', '.join(ENGINES)}")
        _engines(args, engines)
        return
    compare_variants(os.path.abspath(__file__), args, VARIANTS, lambda v, steps, out: _trainer(args, v, steps, out),
                     _size_flags(args), "HF Trainer step")


if __name__ == "__main__":
    main()
