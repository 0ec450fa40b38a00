"""torchtitan step time with and without AGG: the real Trainer, 2 gloo ranks (FSDP2 dp_shard=2), CPU.

    python benchmarks/torchtitan_step.py                        # 6-layer debug model, seq 256
    python benchmarks/torchtitan_step.py --layers 2 --seq-len 32 --steps 6 --rounds 1   # smoke run
    python benchmarks/torchtitan_step.py --vocab 32768 --dim 512    # widened (benchmarks/torchtitan_recipes.py)

Each (variant, round) is one ``torchrun --nproc_per_node 2`` run of llama3's debug model (d=256,
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


def run(args, variant: str, root: str, assets: dict[str, str], index: int) -> float:
    folder = os.path.join(root, f"{variant}_{index}")
    if wide(args):
        module, config = "torchtitan_recipes", "cpu_aniso_wide"
    else:
        module, config = "torchtitan_launcher", "cpu_aniso_6_layers" if args.layers == 6 else "cpu_aniso"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0", os.path.join(TESTS, "torchtitan_launcher.py"),
        "--module", module, "--config", config,
        "--hf_assets_path", assets["tokenizer"], "--dataloader.dataset_path", assets["data_w2"],
        "--dump_folder", folder, "--training.steps", str(args.steps), "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.batch), "--aniso.metrics", *VARIANTS[variant],
    ]  # fmt: skip
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([ROOT, TESTS, HERE]),
        ANISO_BENCH_DIM=str(args.dim),
        ANISO_BENCH_VOCAB=str(args.vocab),
        ANISO_BENCH_LAYERS=str(args.layers),
        HF_DATASETS_CACHE=os.path.join(root, "hf_cache"),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS=str(args.threads),
    )
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{variant} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return statistics.median(step_times(folder)[2:])


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
    args = parser.parse_args()
    variants = args.variants.split(",")

    from torchtitan_data import write_assets

    medians: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as root:
        docs = 2 * args.batch * (args.steps + 1)
        assets = write_assets(os.path.join(root, "assets"), seq_len=args.seq_len, n_docs=docs, local_batch=args.batch, worlds=(2,))
        for index in range(args.rounds):
            for variant in variants:
                medians[variant].append(run(args, variant, root, assets, index))
    base = min(medians["none"])
    tokens = 2 * args.batch * args.seq_len
    print(f"2 ranks (FSDP2 dp_shard=2, gloo), CPU, {args.threads} thread(s)/rank; llama3 debug model, {args.layers} layers, "
          f"d={args.dim}, V={args.vocab}; {tokens} tokens/step; median step of {args.steps - 2}, best of {args.rounds} rounds")  # fmt: skip
    print("| variant | step time (s) | ratio to none |\n|---|---|---|")
    for variant, values in medians.items():
        print(f"| {variant} | {min(values):.3f} | {min(values) / base:.3f} |")


if __name__ == "__main__":
    main()
