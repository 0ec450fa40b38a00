"""The library's own steady-state training step under CUDA's strictest check, one method at a time
(docs/performance.md, "What the GPU pays").

    python benchmarks/strict_step.py                    # CUDA: steady steps under set_sync_debug_mode("error")
    python benchmarks/strict_step.py --device cpu       # smoke: the same steps, host reads counted (HostSyncs)
    python benchmarks/strict_step.py --methods agg,cosreg --dtype bf16

A trainer makes host reads of its own (the HF Trainer 3 per step), so ``"error"`` cannot be on
around a whole trainer step; `host_syncs.py` counts that one. Here the step is the session's
calls and nothing else: a small LM (embedding, one linear block, LM head; d = 64, V = 4096) on the
device, `TrainingSession` set up with the method (``owns_loss=True``: the fused loss where the
method allows it), and 3 optimizer steps of 2 micro-batches of 4 × 64 tokens: ``begin_step`` where
the session wants it, ``begin_micro_batch``, the forward through the head (its loss, or
``F.cross_entropy`` of its logits), backward, ``SGD.step`` (no host read of its own), ``end_step``.
Steps 2 and 3 (the steady state: no first-call set-up, no measurement) run under
``torch.cuda.set_sync_debug_mode("error")``, where any synchronising call raises; on the CPU
`tests/device_discipline.py`'s ``HostSyncs`` counts the reads instead. The table: method |
steady steps | result (ok, or the first line of the error / the count and where).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from device_discipline import TRAINING_METHODS as METHODS  # noqa: E402
from device_discipline import HostSyncs  # noqa: E402

V, D = 4096, 64


class BlockLM(nn.Module):
    """Embedding → one linear block → LM head."""

    def __init__(self, device: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D, device=device, dtype=dtype)
        self.blocks = nn.ModuleList([nn.Linear(D, D, device=device, dtype=dtype)])
        self.lm_head = nn.Linear(D, V, bias=False, device=device, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.blocks[0](self.embed(ids))))


def steady_steps(name: str, device: str, dtype: torch.dtype, steps: int = 3) -> str:
    """Train `steps` optimizer steps with method `name`; the steps after the first under the strict
    check. Returns "ok" or what failed."""
    from aniso_plugins import AnisoConfig
    from aniso_plugins.core.model import ModelHandle
    from aniso_plugins.core.session import TrainingSession

    torch.manual_seed(0)
    once = {"spectrum_c1": 1.0} if name == "spectrum" else {}  # else σ₁ is read once, at the first call
    config = AnisoConfig(load_entry_points=False, **{"metrics": (), **METHODS[name], **once})
    model = BlockLM(device, dtype)
    session = TrainingSession(config)
    session.setup(ModelHandle(model, head="lm_head", input_embedding="embed", blocks="blocks"), owns_loss=True)
    optimizer = torch.optim.SGD(session.handle.model.parameters(), lr=1e-2)
    session.begin_training(accumulation_steps=2)
    g = torch.Generator(device=device).manual_seed(0)
    batches = [[torch.randint(0, V, (4, 64), device=device, generator=g) for _ in range(2)] for _ in range(steps)]
    counted = HostSyncs(where=True) if device == "cpu" else None
    for step, micro in enumerate(batches, start=1):
        strict = step > 1
        if strict and counted is not None:
            counted.__enter__()
        elif strict:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            targets = [torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1) for ids in micro]
            if session.wants_step_targets:
                session.begin_step(targets, step=step)
            for ids, y in zip(micro, targets):
                normalizer = (y != -100).sum()
                session.begin_micro_batch(y, step=step, accumulation_steps=2, loss_normalizer=normalizer)
                with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16 and device == "cuda"):
                    out = model(ids)
                loss = out if session.head_computes_loss else F.cross_entropy(
                    out.flatten(0, 1).float(), y.flatten(), ignore_index=-100, reduction="sum") / normalizer
                (loss / 2).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            session.end_step(step)
        except RuntimeError as error:
            return f"error at step {step}: {str(error).splitlines()[0][:200]}"
        finally:
            if strict and counted is not None:
                counted.__exit__(None, None, None)
            elif strict:
                torch.cuda.set_sync_debug_mode("default")
    session.detach()
    if counted is not None and counted.total:
        where = ", ".join(f"{s} ×{n}" for s, n in sorted(counted.sites.items(), key=lambda kv: -kv[1]))
        return f"{counted.total} host reads: {where}"
    return "ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of " + ", ".join(METHODS))
    a = parser.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu for the smoke run)")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    check = 'set_sync_debug_mode("error")' if a.device == "cuda" else "host reads counted (HostSyncs)"
    print(f"\n### The session's steady training step, {a.device}, {a.dtype}: steps 2-3 under {check}")
    print("| method | steady steps | result |")
    print("|---|---|---|")
    failed = 0
    for name in a.methods.split(","):
        result = steady_steps(name, a.device, dtype)
        failed += result != "ok"
        print(f"| {name} | 2 | {result} |", flush=True)
    print(f"\n{failed} of {len(a.methods.split(','))} methods read a value back in a steady step")


if __name__ == "__main__":
    main()
