"""How the head's cost grows with N and V, where unfused heads run out of memory, and peers in the
same table (docs/performance.md §7).

    python benchmarks/scale.py                                   # the CPU grid of issue 16, fp32 and bf16
    python benchmarks/scale.py --section heads --dtype fp32 --vocab 32768 --tokens 4096
    python benchmarks/scale.py --device cuda --dtype bf16 --vocab 128256 --tokens 4096,16384,32768 \\
        --dim 4096 --extra-dim 0 --variants plain,fused_ones,fused_typical,liger_flce,cce_triton,cce_compile
    python benchmarks/scale.py --smoke                           # tiny sizes, every section (the test suite)

Sections (``--section``, comma-separated):

heads: forward + backward of the head and its loss for every (V, N) of ``--vocab`` × ``--tokens``
at d = ``--dim``, plus d = ``--extra-dim`` at the smallest N. Variants: ``plain``
(``F.cross_entropy(F.linear(x, W).float(), y)``), ``gated_linear`` (+ CE, typical gates),
``fused_ones`` / ``fused_typical`` (`fused_linear_cross_entropy` with gates all ones / typical gates),
``torch_lce`` (PyTorch's own chunked ``F.linear_cross_entropy(x, W, y,
options=torch.nn.LinearCrossEntropyOptions())``, torch >= 2.13, plain CE), ``cce_compile``
(Apple Cut Cross-Entropy, ``linear_cross_entropy(..., impl="torch_compile")``, plain CE), and on
CUDA only ``cce_triton`` (CCE's Triton kernel, ``impl="cce"``) and
``liger_flce`` (Liger-Kernel's fused linear cross-entropy); soft-capped heads (Gemma 2's cap 30:
the CE of 30·tanh(z/30)): ``plain_softcap`` (unfused), ``fused_softcap`` (ours, `LogitTransform`),
``cce_softcap`` (CCE torch_compile with ``softcap=30``); ``fused_options`` (ours with token weights,
class weights and z-loss at once: the per-row options' path); a peer that is not installed or
needs CUDA is skipped with the reason. Inputs: x (N, d) and W (V, d) float32 leaves (bf16:
the step runs under bf16 autocast and the peers get ``x.to(bf16)``, ``W.to(bf16)``), Zipf(1.2)
targets; typical gates from the appearance of 32k-token steps of the same law at α = 0.03
(as benchmarks/agg.py).

- memory: each variant's first step in a fresh process (CPU) or after a peak reset (CUDA),
  `measure.PeakMemory`; on the CPU the worker's address space is limited to
  ``--memory-limit-gib`` beyond what it held after imports and warm-up (``RLIMIT_AS``; the
  default 20 GiB is what a 24 GiB machine leaves one process after the system and other
  load), so a variant that does not fit really runs out: "OOM" cells are such failures, with
  the seconds it ran before the allocation failed;
- time: cells with 6NVd ≤ ``--time-flops`` are timed: after the first step, ``--rounds``
  rounds each run the variant next to a step of ``--baseline`` (plain by default; e.g.
  ``cce_compile`` to pair the fused op with the peer directly) in the same process,
  alternating which goes first, and the table gives the median of these paired ratios and the
  median seconds; cells above it and
  up to ``--run-flops`` run one step (memory, and the seconds of that first step, unpaired);
  above ``--run-flops`` only ``--check-variants`` run, as an out-of-memory check stopped
  after ``--check-seconds`` ("not finished" then); the other cells say "not run" with the
  estimated seconds (6NVd over a measured GEMM rate);
- the peer target of issue 16: fused time ≤ CCE torch_compile time and fused peak ≤ ½ of its
  peak, at every cell where both ran (the median paired ratio with ``--baseline cce_compile``;
  else the ratio of the two median paired ratios to the same plain, or of single steps).

counter: `SlidingTokenCounter` with V = ``--counter-vocab``, ``--counter-tokens`` targets per
step, window K = ``--window``, Zipf(1.2) and uniform targets: median update + step time and
memory with the window full (benchmarks/agg.py's counter benchmark, run for K + 200 steps).

geometry: one full geometry measurement of a V = ``--geometry-vocab``, d = ``--geometry-dim``
head (`GeometryPlugin` through `AnisoPlugins.measure`) and one gradient-bottleneck probe
(``--probe-tokens`` positions: the armed forward + backward and the measurement), each in a
fresh process after a warm-up at a tiny size: wall seconds of the one call and its peak
memory; and a plain head step over the probe's positions as the reference.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from measure import (
    DTYPES,
    PeakMemory,
    add_device_args,
    device_of,
    dtype_list,
    elapsed,
    is_oom,
    limit_memory,
    precision,
    synchronize,
)

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("plain", "gated_linear", "fused_ones", "fused_typical", "torch_lce", "cce_compile", "cce_triton", "liger_flce",
            "plain_softcap", "fused_softcap", "cce_softcap", "fused_options")
LABELS = {
    "plain": "plain F.linear + CE",
    "gated_linear": "gated_linear + CE",
    "fused_ones": "fused, gates 1",
    "fused_typical": "fused, typical gates",
    "torch_lce": "torch linear_cross_entropy",
    "cce_compile": "CCE torch_compile",
    "cce_triton": "CCE Triton",
    "liger_flce": "Liger FLCE",
    "plain_softcap": "plain, soft-cap 30",
    "fused_softcap": "fused, soft-cap 30",
    "cce_softcap": "CCE torch_compile, soft-cap 30",
    "fused_options": "fused, token + class weights, z-loss",
}
SOFTCAP = 30.0
"""Gemma 2's ``final_logit_softcapping``: the soft-capped variants compute CE of 30·tanh(z/30)."""
FUSED = ("fused_ones", "fused_typical")
CCE = "cce_compile"
GIB = 2**30


# --- inputs and steps ------------------------------------------------------------------------
def _zipf(vocab: int, s: float = 1.2) -> torch.Tensor:
    p = torch.arange(1, vocab + 1, dtype=torch.float64).pow(-s)
    return p / p.sum()


@dataclass
class Inputs:
    x: torch.Tensor
    w: torch.Tensor
    y: torch.Tensor
    gates: object
    ones: object


def make_inputs(vocab: int, tokens: int, dim: int, device: torch.device) -> Inputs:
    """x (N, d), W (V, d) float32 leaves on `device`, Zipf targets, typical and all-ones gates."""
    from aniso_plugins import agg_gates

    g = torch.Generator().manual_seed(0)
    probs = _zipf(vocab)
    y = torch.multinomial(probs, tokens, replacement=True, generator=g)
    x = torch.randn(tokens, dim, generator=g)
    w = torch.randn(vocab, dim, generator=g).mul_(0.02)
    typical = agg_gates((probs * 32768).float(), 0.03)
    ones = agg_gates(torch.ones(vocab), 0.03)  # no rare id: every gate is 1
    return Inputs(
        x.to(device).requires_grad_(True),
        w.to(device).requires_grad_(True),
        y.to(device),
        typical.to(device),
        ones.to(device),
    )


def loss_of(variant: str, inp: Inputs, dtype: str, chunk: tuple[int, int]) -> torch.Tensor:
    """The scalar loss of `variant` (run inside `measure.precision`); `chunk`: the fused op's tiles
    (token rows, vocabulary ids; 0: its default)."""
    from aniso_plugins import fused_linear_cross_entropy, gated_linear

    x, w, y = inp.x, inp.w, inp.y
    if variant == "plain":
        return F.cross_entropy(F.linear(x, w).float(), y)
    if variant == "plain_softcap":
        return F.cross_entropy(torch.tanh(F.linear(x, w).float() / SOFTCAP) * SOFTCAP, y)
    if variant == "fused_options":  # the row terms' general path: every per-row option at once
        g = torch.Generator().manual_seed(1)
        tokens = torch.rand(y.shape, generator=g).to(y.device)
        classes = torch.rand(w.shape[0], generator=g).add_(0.5).to(y.device)
        return fused_linear_cross_entropy(x, w, y, **_tiles(chunk), token_weights=tokens, class_weights=classes,
                                          z_loss=1e-4)
    if variant == "fused_softcap":
        from aniso_plugins import LogitTransform

        return fused_linear_cross_entropy(x, w, y, **_tiles(chunk), logit_transform=LogitTransform(softcap=SOFTCAP))
    if variant == "gated_linear":
        return F.cross_entropy(gated_linear(x, w, y, inp.gates).float(), y)
    if variant in FUSED:
        gates = inp.ones if variant == "fused_ones" else inp.gates
        return fused_linear_cross_entropy(x, w, y, gates, **_tiles(chunk))
    peer = DTYPES[dtype]
    if variant == "torch_lce":
        return F.linear_cross_entropy(x.to(peer), w.to(peer), y, options=torch.nn.LinearCrossEntropyOptions())
    if variant in ("cce_compile", "cce_triton", "cce_softcap"):
        from cut_cross_entropy import linear_cross_entropy

        impl = "cce" if variant == "cce_triton" else "torch_compile"
        return linear_cross_entropy(x.to(peer), w.to(peer), y, impl=impl,
                                    softcap=SOFTCAP if variant == "cce_softcap" else None)
    if variant == "liger_flce":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        return LigerFusedLinearCrossEntropyLoss()(w.to(peer), x.to(peer), y)
    raise ValueError(f"unknown variant {variant!r}")


def _tiles(chunk: tuple[int, int]) -> dict:
    return {"chunk_size": chunk[0] or None, "vocab_chunk_size": chunk[1] or None}


def step(variant: str, inp: Inputs, device: torch.device, dtype: str, chunk: tuple[int, int]) -> None:
    """One forward + backward; gradients of x and W are left in .grad."""
    inp.x.grad = inp.w.grad = None
    with precision(device, dtype):
        loss = loss_of(variant, inp, dtype, chunk)
    loss.backward()


def unavailable(variant: str, device: str) -> str | None:
    """Why `variant` cannot run here, or None."""
    if variant in ("cce_triton", "liger_flce") and device != "cuda":
        return "Triton GPU kernel: needs --device cuda"
    if variant == "torch_lce" and not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        return f"torch {torch.__version__} has no chunked linear_cross_entropy (torch >= 2.13)"
    module = {"cce_compile": "cut_cross_entropy", "cce_triton": "cut_cross_entropy", "cce_softcap": "cut_cross_entropy",
              "liger_flce": "liger_kernel"}
    if variant in module:
        try:
            __import__(module[variant])
        except Exception as exc:  # noqa: BLE001 - not installed, or its import fails on this machine
            return f"{module[variant]} unavailable ({type(exc).__name__}: {str(exc)[:80]})"
    return None


# --- worker: one process, some variants at one cell ---------------------------------------------
def _warm_up(variants: list[str], device: torch.device, dtype: str, chunk: tuple[int, int]) -> dict[str, str]:
    """First-call costs (imports, torch.compile of the peer at dynamic shapes) at tiny sizes;
    returns the error of each variant whose warm-up failed."""
    failed: dict[str, str] = {}
    for tokens in (64, 128):
        tiny = make_inputs(256, tokens, 64, device)
        for v in variants:
            if v in failed:
                continue
            try:
                step(v, tiny, device, dtype, chunk)
            except Exception as exc:  # noqa: BLE001 - a peer that fails is reported, not fatal
                failed[v] = f"warm-up: {type(exc).__name__}: {str(exc)[:120]}"
    synchronize(device)
    return failed


def _free(inp: Inputs, device: torch.device) -> None:
    inp.x.grad = inp.w.grad = None
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _measure_variant(v: str, inp: Inputs, args, device: torch.device, pair: bool) -> dict:
    """First step (peak memory, seconds; on CUDA after one untimed step at the same size, which
    absorbs Triton autotuning), then `args.rounds` rounds paired with `args.baseline`. An allocation
    failure is an "oom" result, any other error a "failed" one (a peer never stops the run)."""
    run = lambda name: elapsed(lambda: step(name, inp, device, args.dtype, (args.chunk, args.vocab_chunk)), device)
    start = time.perf_counter()
    try:
        if device.type == "cuda":
            run(v)
        with PeakMemory(device) as peak:
            first = run(v)
    except Exception as exc:  # noqa: BLE001 - reported in the table: a peer never stops the run
        _free(inp, device)
        status = "oom" if is_oom(exc) else "failed"
        return {"variant": v, "status": status, "after_s": time.perf_counter() - start, "note": str(exc)[:160]}
    _free(inp, device)
    out = {"variant": v, "status": "ok", "peak": peak.bytes, "first_s": first, "times": [], "ratios": []}
    for r in range(args.rounds):
        if not pair or v == args.baseline:
            out["times"].append(run(v))
            continue
        if r % 2:
            tv, tp = run(v), run(args.baseline)
        else:
            tp, tv = run(args.baseline), run(v)
        out["times"].append(tv)
        out["ratios"].append(tv / tp)
    _free(inp, device)
    return out


def worker(args) -> None:
    """Runs `args.variants` at the cell `args.cell`, printing one JSON line per variant."""
    torch.set_num_threads(args.threads)
    device = device_of(args)
    vocab, tokens, dim = (int(s) for s in args.cell.split(","))
    variants = args.variants.split(",")
    failed = _warm_up(sorted(set(variants) | ({args.baseline} if args.pair else set())), device, args.dtype,
                      (args.chunk, args.vocab_chunk))
    if device.type == "cpu":
        limit_memory(args.memory_limit_gib)
    try:
        inp = make_inputs(vocab, tokens, dim, device)
    except Exception as exc:
        if not is_oom(exc):
            raise
        for v in variants:
            print(json.dumps({"variant": v, "status": "oom", "after_s": 0.0, "note": "inputs: " + str(exc)[:120]}))
        return
    pair = args.pair and args.baseline not in failed
    for v in variants:
        if v in failed:
            print(json.dumps({"variant": v, "status": "failed", "note": failed[v]}), flush=True)
            continue
        result = _measure_variant(v, inp, args, device, pair)
        pair = pair and not (v == args.baseline and result["status"] != "ok")
        print(json.dumps(result), flush=True)


# --- driver ------------------------------------------------------------------------------------
@dataclass
class Cell:
    vocab: int
    tokens: int
    dim: int
    dtype: str
    results: dict[str, dict] = field(default_factory=dict)

    @property
    def flops(self) -> float:
        return 6.0 * self.tokens * self.vocab * self.dim


def gemm_rate(device: torch.device, dtype: str, dim: int) -> float:
    """Measured flop/s of a (1024 × d) · (d × 8192) GEMM under the step's precision."""
    a = torch.randn(1024, dim, device=device)
    b = torch.randn(8192, dim, device=device)
    with precision(device, dtype):
        F.linear(a, b)
        seconds = min(elapsed(lambda: F.linear(a, b), device) for _ in range(3))
    return 2.0 * 1024 * 8192 * dim / seconds


def _worker_cmd(args, cell: Cell, variants: list[str], pair: bool, rounds: int) -> list[str]:
    return [
        sys.executable, os.path.abspath(__file__), "--worker", "--cell", f"{cell.vocab},{cell.tokens},{cell.dim}",
        "--variants", ",".join(variants), "--dtype", cell.dtype, "--device", args.device,
        "--threads", str(args.threads), "--chunk", str(args.chunk), "--vocab-chunk", str(args.vocab_chunk),
        "--rounds", str(rounds),
        "--memory-limit-gib", str(args.memory_limit_gib), "--baseline", args.baseline, *(["--pair"] if pair else []),
    ]  # fmt: skip


def _spawn(cmd: list[str], timeout: float | None) -> tuple[list[dict], str | None]:
    """Run a worker; its JSON lines, and an error note (crash or timeout) or None."""
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    try:
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")], f"not finished in {timeout:.0f} s"
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode:
        return lines, f"worker exit {done.returncode}: {done.stderr.strip().splitlines()[-1:] or ['']}"[:200]
    return lines, None


def run_cell(args, cell: Cell, variants: list[str], est_s: float) -> None:
    """Fill `cell.results` for `variants` according to the cell's flop budget."""
    mode = "time" if cell.flops <= args.time_flops else "run" if cell.flops <= args.run_flops else "check"
    rounds = args.rounds if mode == "time" else 0
    runnable = []
    for v in variants:
        reason = unavailable(v, args.device)
        if reason:
            cell.results[v] = {"status": "skipped", "note": reason}
        elif mode == "check" and v not in args.check_variants.split(","):
            cell.results[v] = {"status": "not run", "note": f"est. {est_s:.0f} s > --run-flops"}
        else:
            runnable.append(v)
    timeout = args.check_seconds if mode == "check" else None
    groups = [runnable] if args.device == "cuda" else [[v] for v in runnable]
    for group in groups:
        ok = cell.results.get(args.baseline, {}).get("status", "ok") == "ok"
        pair = mode == "time" and args.baseline in variants and ok
        lines, note = _spawn(_worker_cmd(args, cell, group, pair, rounds), timeout)
        for line in lines:
            cell.results[line["variant"]] = line
        for v in group:
            if v not in cell.results:
                cell.results[v] = {"status": "not finished" if note and "not finished" in note else "failed", "note": note}
        summary = {v: cell.results[v].get("status") for v in group}
        print(f"[{cell.dtype} V={cell.vocab} N={cell.tokens} d={cell.dim} {mode}] {summary}", file=sys.stderr, flush=True)
        for v in group:  # the raw result, so that an interrupted run keeps what it measured
            print("result " + json.dumps({"cell": [cell.vocab, cell.tokens, cell.dim, cell.dtype], **cell.results[v], "variant": v}),
                  file=sys.stderr, flush=True)  # fmt: skip


def _mem_cell(r: dict, ref: dict | None) -> str:
    if r["status"] == "ok":
        ratio = f" ({r['peak'] / ref['peak']:.2f}×)" if ref and ref.get("status") == "ok" and ref["peak"] else ""
        return f"{r['peak'] / GIB:.3g}{ratio}"
    if r["status"] == "oom":
        return f"OOM after {r['after_s']:.0f} s"
    if r["status"] == "failed":
        return f"failed: {r['note']}"
    return f"{r['status']}" + (f": {r['note']}" if r.get("note") else "")


def _time_cell(r: dict) -> str:
    if r["status"] != "ok":
        return "-"
    if r["ratios"]:
        return f"{statistics.median(r['ratios']):.2f}× ({statistics.median(r['times']):.2f} s)"
    if r["times"]:
        return f"{statistics.median(r['times']):.2f} s"
    return f"{r['first_s']:.1f} s (1 step)"


def _seconds(r: dict) -> float:
    return statistics.median(r["times"]) if r["times"] else r["first_s"]


def peer_ratios(cell: Cell, fused: str, baseline: str = "plain") -> tuple[float, float, bool] | None:
    """(time fused / CCE, peak fused / CCE, paired) where both ran: the median paired ratio when
    CCE was the `baseline`, else the ratio of the median paired ratios to the same plain, else
    of the single steps."""
    a, b = cell.results.get(fused, {}), cell.results.get(CCE, {})
    if a.get("status") != "ok" or b.get("status") != "ok":
        return None
    if a["ratios"] and baseline == CCE:
        t, paired = statistics.median(a["ratios"]), True
    else:
        paired = bool(a["ratios"] and b["ratios"])
        t = statistics.median(a["ratios"]) / statistics.median(b["ratios"]) if paired else _seconds(a) / _seconds(b)
    return t, a["peak"] / b["peak"] if b["peak"] else math.nan, paired  # a zero peak: below the RSS resolution


def _chunk_text(rows: int, ids: int) -> str:
    if rows or ids:
        return f"{rows or 'all'} rows × {ids or 'all'} ids"
    return "plan_tiles(N, V, d) (PyTorch's chunk: its whole rows where ≥ 64, else every row × a block of ids)"


def print_tables(cells: list[Cell], variants: list[str], args, rates: dict[str, float]) -> None:
    for dtype in dict.fromkeys(c.dtype for c in cells):
        rows = [c for c in cells if c.dtype == dtype]
        print(
            f"\n### Head + loss, forward + backward, {dtype} ({'bf16 autocast' if dtype == 'bf16' else 'float32'}), "
            f"{args.device}, {args.threads} threads, fused tiles of {_chunk_text(args.chunk, args.vocab_chunk)}; GEMM rate "
            f"{rates[dtype] / 1e9:.1f} Gflop/s; memory limit {args.memory_limit_gib:g} GiB per process\n"
        )
        print("Peak extra memory, GiB (× plain):\n")
        print("| V | N | d | 6NVd Tflop | est. s | " + " | ".join(LABELS[v] for v in variants) + " |")
        print("|---" * (5 + len(variants)) + "|")
        for c in rows:
            ref = c.results.get("plain")
            cols = " | ".join(_mem_cell(c.results[v], ref) for v in variants)
            print(f"| {c.vocab} | {c.tokens} | {c.dim} | {c.flops / 1e12:.2f} | {c.flops / rates[dtype]:.0f} | {cols} |")
        print(f"\nTime: median paired ratio to {LABELS[args.baseline]} (median s) for timed cells; "
              "otherwise the seconds of the single first step:\n")  # fmt: skip
        print("| V | N | d | " + " | ".join(LABELS[v] for v in variants) + " |")
        print("|---" * (3 + len(variants)) + "|")
        for c in rows:
            print(f"| {c.vocab} | {c.tokens} | {c.dim} | " + " | ".join(_time_cell(c.results[v]) for v in variants) + " |")
        if CCE in variants and any(f in variants for f in FUSED):
            print("\nPeer target (fused time ≤ CCE torch_compile, fused peak ≤ 0.5 × CCE):\n")
            print("| V | N | d | fused | time / CCE | peak / CCE | met |\n|---|---|---|---|---|---|---|")
            for c in rows:
                for f in FUSED:
                    got = peer_ratios(c, f, args.baseline) if f in variants else None
                    if got:
                        t, m, paired = got
                        ok = "yes" if t <= 1.0 and m <= 0.5 else "no"
                        print(f"| {c.vocab} | {c.tokens} | {c.dim} | {LABELS[f]} | {t:.2f}{'' if paired else ' (1 step)'} | {m:.3f} | {ok} |")
        print("\nLargest N × V that ran (memory measured), per variant:\n")
        for v in variants:
            ok = [c for c in rows if c.results[v].get("status") == "ok"]
            failed = [c for c in rows if c.results[v].get("status") == "oom"]
            best = max(ok, key=lambda c: c.tokens * c.vocab, default=None)
            first_fail = min(failed, key=lambda c: c.tokens * c.vocab, default=None)
            text = f"{best.tokens} × {best.vocab} = {best.tokens * best.vocab:.3g} (d={best.dim})" if best else "none"
            if first_fail:
                text += f"; smallest OOM: {first_fail.tokens} × {first_fail.vocab} (d={first_fail.dim})"
            print(f"- {LABELS[v]}: {text}")


def merged_cells(paths: list[str]) -> list[Cell]:
    """Cells from the ``result`` lines that drivers print to stderr (later lines replace earlier
    ones for the same cell and variant), in order of first appearance."""
    cells: dict[tuple, Cell] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.startswith("result ") and '"variant"' in line:
                    r = json.loads(line[len("result "):])
                    vocab, tokens, dim, dtype = r.pop("cell")
                    cell = cells.setdefault((vocab, tokens, dim, dtype), Cell(vocab, tokens, dim, dtype))
                    cell.results[r["variant"]] = r
    return list(cells.values())


def merge(args) -> None:
    """Prints the tables of several driver runs' stderr logs (`args.tables_from`): a grid run in
    pieces under a flop budget. Cells or variants no run measured say "not run"."""
    cells = merged_cells(args.tables_from)
    variants = [v for v in VARIANTS if any(v in c.results for c in cells)]
    for c in cells:
        for v in variants:
            c.results.setdefault(v, {"status": "not run"})
    device = device_of(args)
    rates = {dtype: gemm_rate(device, dtype, args.dim) for dtype in dict.fromkeys(c.dtype for c in cells)}
    print_tables(cells, variants, args, rates)


def heads(args) -> None:
    device = device_of(args)
    torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    if args.baseline not in variants:  # plain by default: the memory table's reference too
        variants.insert(0, args.baseline)
    tokens = [int(t) for t in args.tokens.split(",")]
    vocabs = [int(v) for v in args.vocab.split(",")]
    shapes = [(v, n, args.dim) for v in vocabs for n in tokens]
    if args.extra_dim:
        shapes += [(v, min(tokens), args.extra_dim) for v in vocabs]
    cells, rates = [], {}
    for dtype in dtype_list(args.dtype):
        rates[dtype] = gemm_rate(device, dtype, args.dim)
        for vocab, n, dim in shapes:
            cell = Cell(vocab, n, dim, dtype)
            run_cell(args, cell, variants, cell.flops / rates[dtype])
            cells.append(cell)
    print_tables(cells, variants, args, rates)


# --- counter and geometry sections ---------------------------------------------------------------
def counter(args) -> None:
    from agg import counter_benchmark

    ns = argparse.Namespace(
        threads=args.threads,
        vocab=args.counter_vocab,
        window=args.window,
        counter_steps=args.window + 200,
        counter_tokens=args.counter_tokens,
        device=args.device,
    )
    print(f"\n### Token counter, V={ns.vocab}, {ns.counter_tokens} targets/step, K={ns.window}, "
          f"{ns.counter_steps} steps (window full), targets on {args.device}\n")  # fmt: skip
    print("| targets | tokens/step | V | K | update+step ms (median) | appearance+gates ms | memory MiB "
          "| dense (K+1)xV fp32 MiB | ratio |\n|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for line in counter_benchmark(ns):
        print(line, flush=True)


def geometry_case(args) -> None:
    """Worker: one geometry case at the configured size, printing time and peak memory as JSON."""
    from torch import nn

    from aniso_plugins import AnisoConfig, AnisoPlugins, ModelHandle, StepInfo

    torch.set_num_threads(args.threads)
    device = device_of(args)

    def build(vocab: int, dim: int, tokens: int):
        head = nn.Linear(dim, vocab, bias=False, device=device)
        with torch.no_grad():
            head.weight.normal_(0.0, 0.02).add_(0.01)  # a mildly anisotropic head (benchmarks/metrics.py)
        model = nn.Module()
        model.lm_head = head
        metric = "bottleneck" if args.geometry_case == "probe" else "geometry"
        plugins = AnisoPlugins(AnisoConfig(metrics=(metric,), load_entry_points=False))
        plugins.setup(ModelHandle(model, head="lm_head"))
        h = torch.randn(tokens, dim, device=device)
        y = torch.randint(0, vocab, (tokens,), device=device)
        return head, plugins, h, y

    def head_step(head: nn.Module, h: torch.Tensor, y: torch.Tensor) -> None:
        x = h.clone().requires_grad_(True)
        with precision(device, args.dtype):
            loss = F.cross_entropy(head(x).float(), y)
        loss.backward()
        head.weight.grad = None

    def case(head, plugins, h, y) -> Callable[[], None]:
        info = StepInfo(step=1, measure=True)
        if args.geometry_case == "geometry":
            return lambda: plugins.measure(info)
        if args.geometry_case == "head step":
            return lambda: head_step(head, h, y)

        def probe() -> None:
            plugins.targets(y, info)
            head_step(head, h, y)
            plugins.measure(info)

        return probe

    case(*build(64, 16, 32))()  # warm-up at a tiny size
    fn = case(*build(args.geometry_vocab, args.geometry_dim, args.probe_tokens))
    with PeakMemory(device) as peak:
        seconds = elapsed(fn, device)
    print(json.dumps({"case": args.geometry_case, "seconds": seconds, "peak": peak.bytes}))


def geometry(args) -> None:
    v, d, n = args.geometry_vocab, args.geometry_dim, args.probe_tokens
    dtype = dtype_list(args.dtype)[0]
    base = [sys.executable, os.path.abspath(__file__), "--device", args.device, "--dtype", dtype,
            "--threads", str(args.threads), "--geometry-vocab", str(v), "--geometry-dim", str(d),
            "--probe-tokens", str(n)]  # fmt: skip
    results = {}
    for name in ("head step", "geometry", "probe"):
        lines, note = _spawn(base + ["--geometry-case", name], None)
        if note or not lines:
            raise SystemExit(f"geometry case {name!r} failed: {note}")
        results[name] = lines[-1]
        print(f"[geometry {name}] {results[name]}", file=sys.stderr, flush=True)
    ref = results["head step"]["seconds"]
    print(f"\n### Geometry measurement and bottleneck probe, V={v}, d={d}, probe over N={n} positions, "
          f"{args.device} {dtype}, {args.threads} threads; one call each in a fresh process after a tiny warm-up\n")  # fmt: skip
    print("| case | wall s | / head step | peak extra GiB |\n|---|---|---|---|")
    labels = {"head step": f"plain head step, N={n} (reference)", "geometry": "geometry measurement (all metrics)",
              "probe": f"probe: armed step + measurement, N={n}"}  # fmt: skip
    for name, r in results.items():
        print(f"| {labels[name]} | {r['seconds']:.3g} | {r['seconds'] / ref:.2f} | {r['peak'] / GIB:.3g} |")
    extra = results["probe"]["seconds"] - ref
    print(f"\nprobe overhead over a plain step: {extra:.2f} s ({extra / ref:+.0%}); "
          f"geometry measurement = {results['geometry']['seconds'] / ref:.2f} plain head steps of N={n}")


# --- command line ----------------------------------------------------------------------------------
SMOKE = {
    "vocab": "512,1024", "tokens": "64,128", "dim": 32, "extra_dim": 48, "rounds": 1, "counter_vocab": 1000,
    "counter_tokens": 500, "window": 20, "geometry_vocab": 512, "geometry_dim": 32, "probe_tokens": 64,
    "time_flops": 1e12, "run_flops": 1e12, "memory_limit_gib": 4.0,
}  # fmt: skip


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(p, dtypes="fp32,bf16", several=True)
    p.add_argument("--section", default="heads,counter,geometry", help="comma-separated: heads, counter, geometry")
    p.add_argument("--smoke", action="store_true", help="tiny sizes for every section (the test suite's run)")
    p.add_argument("--vocab", default="32768,131072,262144")
    p.add_argument("--tokens", default="4096,16384,65536")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--extra-dim", type=int, default=2048, help="second d, at the smallest N (0: none)")
    p.add_argument("--variants", default="plain,gated_linear,fused_ones,fused_typical,cce_compile")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chunk", type=int, default=0,
                   help="token rows per tile of the fused op (0: its default, plan_tiles(N, V, d))")
    p.add_argument("--vocab-chunk", type=int, default=0,
                   help="vocabulary ids per tile of the fused op (0: its default, plan_tiles(N, V, d))")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds per variant (each next to a --baseline step)")
    p.add_argument("--baseline", default="plain", choices=VARIANTS, help="the variant every timed step is paired with")
    p.add_argument("--time-flops", type=float, default=2.6e12, help="time cells with 6NVd at most this")
    p.add_argument("--run-flops", type=float, default=1.0e13, help="run one step at cells with 6NVd at most this")
    p.add_argument("--check-variants", default="plain,gated_linear,cce_compile",
                   help="variants run as an out-of-memory check above --run-flops")  # fmt: skip
    p.add_argument("--check-seconds", type=float, default=120.0)
    p.add_argument("--memory-limit-gib", type=float, default=20.0)
    p.add_argument("--counter-vocab", type=int, default=262144)
    p.add_argument("--counter-tokens", type=int, default=65536)
    p.add_argument("--window", type=int, default=10000)
    p.add_argument("--geometry-vocab", type=int, default=131072)
    p.add_argument("--geometry-dim", type=int, default=4096)
    p.add_argument("--probe-tokens", type=int, default=4096)
    p.add_argument("--tables-from", nargs="+", metavar="LOG",
                   help="print the tables of earlier runs from their stderr logs (result lines), run nothing")  # fmt: skip
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cell", help=argparse.SUPPRESS)
    p.add_argument("--pair", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--geometry-case", choices=("head step", "geometry", "probe"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.worker:
        worker(args)
        return
    if args.geometry_case:
        geometry_case(args)
        return
    if args.tables_from:
        merge(args)
        return
    sections = {"heads": heads, "counter": counter, "geometry": geometry}
    for name in args.section.split(","):
        sections[name](args)


if __name__ == "__main__":
    main()
