"""The benchmark scripts' machinery on the CPU: memory measurement against known allocations, a
memory-limited worker that really runs out, and `benchmarks/gpu.sh --device cpu` (smoke mode)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)

from measure import is_oom

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, BENCH]), TORCHINDUCTOR_COMPILE_THREADS="1")


def _worker(cell: str, variant: str, limit_gib: float, *extra: str) -> dict:
    """One variant's first step in a fresh memory-limited worker of benchmarks/scale.py (256-row chunks)."""
    cmd = [sys.executable, os.path.join(BENCH, "scale.py"), "--worker", "--cell", cell, "--variants", variant,
           "--dtype", "fp32", "--threads", "1", "--rounds", "0", "--chunk", "256",
           "--memory-limit-gib", str(limit_gib), *extra]  # fmt: skip
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return line


def test_worker_pairs_each_round_with_the_baseline_and_the_peer_ratio_is_the_paired_median():
    """--baseline: every timed round of the variant runs next to a step of the baseline in the
    same process; with CCE as the baseline the peer table's time is the median paired ratio."""
    import scale

    line = _worker("4096,512,32", "fused_typical", 8.0, "--rounds", "3", "--pair", "--baseline", "fused_ones")
    assert line["status"] == "ok" and len(line["times"]) == 3 and len(line["ratios"]) == 3
    assert all(r > 0 for r in line["ratios"])
    cell = scale.Cell(4096, 512, 32, "fp32")
    cell.results = {"fused_typical": {"status": "ok", "peak": 10, "ratios": [0.9, 1.2, 0.95], "times": [1.0]},
                    "cce_compile": {"status": "ok", "peak": 40, "ratios": [], "times": [3.0]}}  # fmt: skip
    assert scale.peer_ratios(cell, "fused_typical", "cce_compile") == (0.95, 0.25, True)
    assert scale.peer_ratios(cell, "fused_typical", "plain") == (1.0 / 3.0, 0.25, False)  # no CCE ratios: seconds


PEAK_OF_A_KNOWN_BLOCK = """
import torch
from measure import PeakMemory
size = 64 * 2**20  # float32 elements: 256 MiB
warm = torch.ones(2 * size)
del warm
with PeakMemory(torch.device("cpu")) as peak:
    block = torch.ones(size)
    del block
print(peak.bytes)
"""


def test_peak_memory_of_a_known_allocation():
    """The CPU peak of a block that allocates, touches and frees 256 MiB is 256 MiB (-3%, +8%), and
    freed memory before the block does not count. In a fresh process, as the benchmarks measure
    (in the test process the allocator's history of earlier tests decides what a block costs:
    a 0-byte peak was seen with the suite run in another order)."""
    done = subprocess.run([sys.executable, "-c", PEAK_OF_A_KNOWN_BLOCK], check=False, capture_output=True, text=True,
                          env=ENV, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert 0.97 * 256 * 2**20 <= int(done.stdout.split()[-1]) <= 1.08 * 256 * 2**20


def test_is_oom_recognises_allocation_failures():
    assert is_oom(MemoryError())
    assert is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
    assert not is_oom(RuntimeError("shape mismatch"))


def test_worker_runs_out_under_the_memory_limit_and_fused_fits():
    """V = 16384, N = 2048: the plain head's float32 logits alone are 128 MiB; under a 96 MiB
    limit plain and gated_linear really run out, the fused op (one 256-row chunk of 16 MiB, dW
    of 2 MiB) runs, and its measured peak is below one logits tensor."""
    lines = {v: _worker("16384,2048,32", v, 96 / 1024) for v in ("plain", "gated_linear", "fused_typical")}
    assert lines["plain"]["status"] == "oom" and lines["gated_linear"]["status"] == "oom"
    assert lines["fused_typical"]["status"] == "ok"
    assert lines["fused_typical"]["peak"] < 128 * 2**20


def test_plain_peak_is_a_few_logits_tensors():
    """Without a binding limit the plain head's peak is 2-4 float32 N×V tensors (logits,
    log-softmax, logit gradient; docs/performance.md §2), the fused one's well below one."""
    lines = {v: _worker("8192,2048,32", v, 8.0) for v in ("plain", "fused_ones")}
    logits = 8192 * 2048 * 4
    assert 2 * logits <= lines["plain"]["peak"] <= 4.5 * logits
    assert lines["fused_ones"]["peak"] < logits


def test_torch_peer_runs_and_its_loss_is_plain_cross_entropy():
    """The torch_lce variant (F.linear_cross_entropy, chunked) runs in a worker, and its loss on
    the benchmark's inputs is F.cross_entropy of the explicit logits (float64 reference)."""
    import scale

    line = _worker("2048,512,32", "torch_lce", 8.0)
    assert line["status"] == "ok" and line["peak"] > 0
    inp = scale.make_inputs(2048, 512, 32, torch.device("cpu"))
    with torch.no_grad():
        got = scale.loss_of("torch_lce", inp, "fp32", 0)
        want = torch.nn.functional.cross_entropy(inp.x.double() @ inp.w.double().T, inp.y)
    assert float(got) == pytest.approx(float(want), rel=1e-5)


@pytest.mark.slow
def test_gpu_script_smoke_mode_prints_every_table(tmp_path):
    """`bash benchmarks/gpu.sh --device cpu`: the three GPU runs at tiny sizes; the GPU-only
    peers are skipped with their reason, not crashed."""
    fake = tmp_path / "bin"  # a `python` first on PATH that is not this interpreter: the script must not use it
    fake.mkdir()
    (fake / "python").write_text("#!/bin/sh\nexit 97\n")
    (fake / "python").chmod(0o755)
    env = {**ENV, "PYTHON": sys.executable, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", os.path.join(BENCH, "gpu.sh"), "--device", "cpu"], check=False, capture_output=True,
                          text=True, env=env, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for title in ("### Head + loss", "Peak extra memory", "Time:", "Peer target", "### Token counter", "### Geometry"):
        assert title in out, title
    assert "skipped: Triton GPU kernel: needs --device cuda" in out
    assert "OOM" not in out
    for variant in ("plain", "fused_ones", "fused_typical", "torch_lce"):  # ours and torch's ran at both cells
        assert done.stderr.count(f"{{'{variant}': 'ok'}}") == 2, variant
    assert "| zipf1.2 |" in out and "| uniform |" in out
    assert "host syncs per steady-state step" in out and re.search(r"\| agg \| \d+ \| 0 \| — \|", out)  # beyond the plain Trainer's: 0
    assert out.count("| agg | 2 | ok |") == 2 and "0 of 3 methods read a value back" in out  # strict_step.py, fp32 and bf16


@pytest.mark.parametrize("script, variants", [
    ("hf_step.py", ["plain", "mle_fused", "agg_fused", "agg_gated"]),  # real transformers.Trainer runs
    ("trl_step.py", ["plain", "agg", "cosreg", "agg_logits"]),  # real trl.SFTTrainer runs
])
def test_trainer_step_benchmarks_run_every_variant_in_smoke_mode(tmp_path, script, variants):
    """benchmarks/hf_step.py and trl_step.py --smoke: four trainer variants, a table and the JSON of its numbers."""
    cmd = [sys.executable, os.path.join(BENCH, script), "--smoke", "--out", str(tmp_path)]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1].strip() for line in done.stdout.splitlines() if line.startswith("| ") and "variant" not in line]
    assert rows == variants
    (result,) = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"seconds"')]
    assert result["ratios"]["plain"] == 1.0 and all(b > 0 for b in result["peak_bytes"].values())


@pytest.mark.slow
def test_hf_step_benchmark_runs_every_engine_on_two_ranks_in_smoke_mode(tmp_path):
    """benchmarks/hf_step.py --engine ddp,fsdp2,zero2,zero3 --smoke: plain against AGG + metrics on
    2 gloo processes per engine, a table row per engine and rank with finite numbers, and the JSON."""
    engines = ["ddp", "fsdp2", "zero2", "zero3"]
    cmd = [sys.executable, os.path.join(BENCH, "hf_step.py"), "--smoke", "--engine", ",".join(engines),
           "--out", str(tmp_path)]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=ENV, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in done.stdout.splitlines()
            if line.startswith("| ") and "engine" not in line]  # fmt: skip
    assert [(r[0], r[1]) for r in rows] == [(e, rank) for e in engines for rank in ("0", "1")]
    for row in rows:
        numbers = [float(c) for c in row[2:]]
        assert len(numbers) == 6 and all(math.isfinite(x) and x >= 0 for x in numbers), row
        assert numbers[0] > 0 and numbers[1] > 0 and numbers[2] > 0, row  # step times and their ratio
    with open(tmp_path / "hf_step_engines.json") as f:
        result = json.load(f)
    assert sorted(result["engines"]) == sorted(engines) and not result["failed"]
    assert all(len(result["engines"][e]) == 2 for e in engines)


@pytest.mark.slow
def test_vocab_parallel_benchmark_runs_two_ranks_and_their_loss_is_the_one_ranks():
    """benchmarks/vocab_parallel.py at tiny sizes: one table row per V, the 2-rank loss equal to the 1-rank one."""
    cmd = [sys.executable, os.path.join(BENCH, "vocab_parallel.py"), "--tokens", "256", "--vocab", "512,1000",
           "--dim", "16", "--rounds", "1"]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith("| ") and "V |" not in line]
    assert [r[1].strip() for r in rows] == ["512", "1000"] and all(r[8].strip() == "yes" for r in rows)


def test_the_strict_step_names_a_host_read_in_the_sessions_step(monkeypatch):
    """benchmarks/strict_step.py on the CPU counts the reads of the session's steady steps: none
    for AGG and CosReg; one planted in `end_step` is reported with its line."""
    sys.path.insert(0, BENCH)
    import strict_step

    from aniso_plugins.core.session import TrainingSession

    assert strict_step.steady_steps("agg", "cpu", torch.float32) == "ok"
    assert strict_step.steady_steps("cosreg", "cpu", torch.float32) == "ok"
    original = TrainingSession.end_step

    def reads_back(self, step):
        float(torch.ones(2).sum())
        return original(self, step)

    monkeypatch.setattr(TrainingSession, "end_step", reads_back)
    result = strict_step.steady_steps("agg", "cpu", torch.float32)
    assert result.startswith("2 host reads: ") and "test_benchmarks_smoke.py" in result, result
