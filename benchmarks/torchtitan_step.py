"""torchtitan step time and peak memory per rank with and without AGG, per parallel layout: the real Trainer, gloo, CPU.

    python benchmarks/torchtitan_step.py                        # FSDP2 dp_shard=2, 6-layer debug model, seq 256
    python benchmarks/torchtitan_step.py --layouts fsdp,dp_replicate,hsdp,tp,fsdp_tp,pp,ep
    python benchmarks/torchtitan_step.py --layers 2 --seq-len 32 --steps 6 --rounds 1   # smoke run
    python benchmarks/torchtitan_step.py --vocab 32768 --dim 512    # widened (benchmarks/torchtitan_recipes.py)

Layouts (`LAYOUTS`): fsdp (dp_shard=2), dp_replicate (2), hsdp (2×2, 4 ranks), tp (2, loss parallel:
the vocabulary-parallel fused loss), fsdp_tp (2×2), pp (2 stages, 1F1B), ep (Qwen3 MoE debug model,
dp_shard=2 × ep=2; not with ``--dim``/``--vocab``). Each rank takes ``--batch`` sequences per step
(a TP or PP group shares them). Peak memory per rank: each rank's peak resident set size
(``VmHWM``, the whole process: model, optimizer, activations), the largest over the ranks.

Each (layout, variant, round) is one ``torchrun`` run of llama3's debug model (d=256,
V=2048, SDPA attention, float32; tests/torchtitan_launcher.py patches torchtitan for the CPU), or
of the same layout at ``--dim`` / ``--vocab`` (`torchtitan_recipes.cpu_aniso_wide`),
on the project's synthetic data; rounds are interleaved over the variants, so load from other
processes hits them alike. Step time: torchtitan's own ``time_metrics/end_to_end(s)`` (wall time
per step, logged every step), median over the steps after the first two, minimum of the medians
over rounds. Variants (``--aniso.metrics`` empty: methods only):

- none: ``--aniso.method none``, the stock torchtitan computation (tests/test_torchtitan.py);
- agg: AGG as the fused chunked cross-entropy that the AGG head (`TrainingHead`) returns (the default here);
- agg_unfused: AGG by the core's gated head on each of torchtitan's 8 logit chunks.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TESTS = os.path.join(ROOT, "tests")
sys.path.insert(0, TESTS)

LAYOUTS = {  # name: (ranks, data-parallel ranks, flags)
    "fsdp": (2, 2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "dp_replicate": (2, 2, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]),
    "hsdp": (4, 4, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]),
    "tp": (2, 1, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]),
    "fsdp_tp": (4, 2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]),
    "pp": (2, 1, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]),
    "ep": (2, 2, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.expert_parallel_degree", "2"]),
}

VARIANTS = {
    "none": ["--aniso.method", "none"],
    "agg": ["--aniso.method", "agg", "--aniso.window", "100"],
    "agg_unfused": ["--aniso.method", "agg", "--aniso.window", "100", "--aniso.fused-loss", "False"],
}


def step_times(folder: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    times: dict[int, float] = {}
    for events in glob.glob(os.path.join(folder, "tb", "*")):
        acc = EventAccumulator(events)
        acc.Reload()
        times.update({e.step: e.value for e in acc.Scalars("time_metrics/end_to_end(s)")})
    return [times[s] for s in sorted(times)]


def wide(args) -> bool:
    """Whether the run needs the widened recipe (any width or vocabulary but the stock 256 / 2048)."""
    return (args.dim, args.vocab) != (256, 2048)


def run(args, layout: str, variant: str, root: str, assets: dict[str, str], index: int) -> tuple[float, int]:
    """(median step seconds, peak resident bytes of the largest rank) of one run."""
    ranks, dp, flags = LAYOUTS[layout]
    folder = os.path.join(root, f"{layout}_{variant}_{index}")
    if layout == "ep":
        module, config = "torchtitan_launcher", "cpu_moe_aniso"
    elif wide(args):
        module, config = "torchtitan_recipes", "cpu_aniso_wide"
    else:
        module, config = "torchtitan_launcher", "cpu_aniso_6_layers" if args.layers == 6 else "cpu_aniso"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0", os.path.join(TESTS, "torchtitan_launcher.py"),
        "--module", module, "--config", config,
        "--hf_assets_path", assets["tokenizer"], "--dataloader.dataset_path", assets[f"data_w{dp}"],
        "--dump_folder", folder, "--training.steps", str(args.steps), "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.batch), *flags, "--aniso.metrics", *VARIANTS[variant],
    ]  # fmt: skip
    peak = os.path.join(root, f"peak_{layout}_{variant}_{index}")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([ROOT, TESTS, HERE]),
        ANISO_BENCH_DIM=str(args.dim),
        ANISO_BENCH_VOCAB=str(args.vocab),
        ANISO_BENCH_LAYERS=str(args.layers),
        ANISO_TT_PEAK=peak,
        HF_DATASETS_CACHE=os.path.join(root, "hf_cache"),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS=str(args.threads),
    )
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{layout} {variant} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    peaks = [int(open(f).read()) * 1024 for f in glob.glob(peak + ".rank*")]
    return statistics.median(step_times(folder)[2:]), max(peaks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, choices=(2, 6), default=6)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--dim", type=int, default=256, help="model width (256: the stock debug model)")
    parser.add_argument("--vocab", type=int, default=2048, help="vocabulary (2048: the stock debug model)")
    parser.add_argument("--device", choices=("cpu",), default="cpu", help="CPU only: 2 gloo ranks")
    parser.add_argument("--dtype", choices=("fp32",), default="fp32", help="the CPU recipes train in float32")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from " + ", ".join(VARIANTS))
    parser.add_argument("--layouts", default="fsdp", help="comma-separated, from " + ", ".join(LAYOUTS))
    args = parser.parse_args()
    variants, layouts = args.variants.split(","), args.layouts.split(",")
    bad = [name for name in layouts if name not in LAYOUTS] + [name for name in variants if name not in VARIANTS]
    if bad or "none" not in variants:
        raise SystemExit(f"--layouts / --variants: unknown {bad} (the baseline 'none' is needed)")

    from torchtitan_data import write_assets

    results: dict[tuple[str, str], list[tuple[float, int]]] = {}
    with tempfile.TemporaryDirectory() as root:
        docs = 4 * args.batch * (args.steps + 1)
        assets = write_assets(os.path.join(root, "assets"), seq_len=args.seq_len, n_docs=docs, local_batch=args.batch,
                              worlds=(1, 2, 4))
        for index in range(args.rounds):
            for layout in layouts:
                for variant in variants:
                    results.setdefault((layout, variant), []).append(run(args, layout, variant, root, assets, index))
    print(f"CPU, gloo, {args.threads} thread(s)/rank; llama3 debug model (ep: Qwen3 MoE debug), {args.layers} layers, "
          f"d={args.dim}, V={args.vocab}; {args.batch} sequences of {args.seq_len} tokens per data-parallel rank and step; "
          f"median step of {args.steps - 2}, best of {args.rounds} rounds")  # fmt: skip
    print("| layout | ranks | variant | step time (s) | time / none | peak MiB per rank | memory / none |\n|---|---|---|---|---|---|---|")
    for layout in layouts:
        base_time = min(t for t, _ in results[(layout, "none")])
        base_peak = min(p for _, p in results[(layout, "none")])
        for variant in variants:
            time_, peak_ = min(t for t, _ in results[(layout, variant)]), min(p for _, p in results[(layout, variant)])
            print(f"| {layout} | {LAYOUTS[layout][0]} | {variant} | {time_:.3f} | {time_ / base_time:.3f} | "
                  f"{peak_ / 2**20:.0f} | {peak_ / base_peak:.3f} |")


if __name__ == "__main__":
    main()
