"""Cost of the contrastive methods and the new measurements, as ratios to a plain LM-head step.

Baseline: ``F.cross_entropy(F.linear(h, W), y)`` forward and backward (gradients of h and W) over
N = B·T tokens, fp32 on CPU, measured in the same process. Each case is timed as what the
plugin runs per call (docs/methods.md §7.1, §9.5, §12-§14):

- SimCTG (§12): `simctg_pair_sums` value + gradient on the (B, T, d) head input, per micro-batch;
- uniformity of the head rows (§13.1): `row_uniformity` exact (blockwise) and sampled, value +
  gradient, once per optimizer step; of the hidden states (§13.2): the same kernel on the N
  head-input rows, per micro-batch;
- SimCSE (§14): mean pooling + InfoNCE value + gradient on 2·B sentence pairs of (T, d) each;
- Ethayarajh (§7.1): counts, word choice and the per-layer sums of `--layers` block outputs,
  per measurement;
- update efficiency (§9.5): P = ∇_H·Wᵀ for k positions and the float64 losses at three ε, per
  probe.

Minimum over interleaved rounds after one warm-up (docs/performance.md §6.2); wall and CPU time
(all threads of this process) are both reported: on a shared machine the CPU-time ratios are the
steadier.

    python benchmarks/contrastive.py        # B=8, T=512, d=256, V=8192, 2 threads
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from measure import add_device_args, device_of, precision
from timing import best_times, print_ratio_table

from aniso_plugins.metrics.bottleneck.probe import (
    hidden_logit_direction,
    sample_loss_positions,
    update_efficiency,
)
from aniso_plugins.metrics.ethayarajh.stats import (
    choose_words,
    layer_stats,
    token_positions,
    word_counts,
)
from aniso_plugins.methods.simcse.contrastive import info_nce, pool
from aniso_plugins.methods.simctg.loss import simctg_pair_sums
from aniso_plugins.methods.uniformity.kernels import row_uniformity


def _backward(loss_of: Callable[[], torch.Tensor], args, *leaves: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        with precision(leaves[0].device, args.dtype):
            loss = loss_of()
        loss.backward()
        for x in leaves:
            x.grad = None

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(parser)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4, help="block outputs measured by the Ethayarajh metric")
    parser.add_argument("--positions", type=int, default=256, help="k of the update-efficiency probe")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dev = device_of(args)
    g = torch.Generator().manual_seed(0)
    b, t, d, v = args.batch, args.seq, args.hidden, args.vocab
    n = b * t
    w = (torch.randn(v, d, generator=g) * 0.02 + 0.01).to(dev).requires_grad_(True)  # a mildly anisotropic head
    h = (torch.randn(b, t, d, generator=g) + 0.5).to(dev).requires_grad_(True)  # hidden states in a cone
    y = torch.randint(0, v, (b, t), generator=g).to(dev)
    valid = torch.ones(b, t, dtype=torch.bool, device=dev)
    sample_gen = torch.Generator(dev).manual_seed(1)
    pairs = (torch.randn(2 * b, t, d, generator=g) + 0.5).to(dev).requires_grad_(True)
    mask = torch.ones(2 * b, t, dtype=torch.long, device=dev)
    ids = (torch.randint(0, v, (b, t), generator=g) % 512).to(dev)  # repeated tokens for SelfSim
    blocks = [torch.randn(b, t, d, generator=g).to(dev) for _ in range(args.layers)]

    def ethayarajh() -> None:
        token_ids, counted = token_positions(y, input_ids=ids, vocab_size=v)
        words = choose_words(word_counts(token_ids, v), 256)
        for x in blocks:
            layer_stats(x, token_ids, counted, words)

    def probe() -> None:
        hh = h.detach().reshape(n, d)
        pick = sample_loss_positions(y, args.positions, torch.Generator(dev).manual_seed(2))
        z = hh[pick] @ w.detach().T
        grad = torch.softmax(z, dim=-1)
        grad[torch.arange(len(pick), device=dev), y.reshape(-1)[pick]] -= 1
        update_efficiency(z, grad, hidden_logit_direction(grad @ w.detach(), w.detach()), y.reshape(-1)[pick], (1e-3, 1e-2, 1e-1))

    cases: dict[str, tuple[str, Callable[[], None]]] = {
        "LM-head step (baseline)": (f"N={n}, V={v}", _backward(lambda: F.cross_entropy(F.linear(h, w).flatten(0, 1).float(), y.flatten()), args, h, w)),
        "SimCTG, block 512": ("per micro-batch", _backward(lambda: simctg_pair_sums(h, valid, 0.5, 512)[0], args, h)),
        "SimCTG, block 128": ("per micro-batch", _backward(lambda: simctg_pair_sums(h, valid, 0.5, 128)[0], args, h)),
        "uniformity of head rows, exact": ("per step, block 1024", _backward(lambda: row_uniformity(w, block=1024), args, w)),
        "uniformity of head rows, sampled": (
            "per step, 1024 rows",
            _backward(lambda: row_uniformity(w, sample=1024, generator=sample_gen), args, w),
        ),
        "uniformity of hidden states": (f"per micro-batch, {n} rows", _backward(lambda: row_uniformity(h.reshape(n, d)), args, h)),
        "SimCSE (mean pooling + InfoNCE)": (
            f"per micro-batch, {b} pairs",
            _backward(lambda: info_nce(*pool(pairs, mask, "mean").unflatten(0, (b, 2)).unbind(1)), args, pairs),
        ),
        "Ethayarajh SelfSim/IntraSim": (f"per measurement, {args.layers} layers", ethayarajh),
        "update efficiency": (f"per probe, k={args.positions}, 3 ε", probe),
    }
    best = best_times({name: run for name, (_, run) in cases.items()}, args.rounds, dev)
    print(f"B={b}, T={t}, d={d}, V={v}, {args.dtype} {args.device}, torch.set_num_threads({args.threads}), min of {args.rounds} rounds")
    print()
    print_ratio_table(best, {name: setting for name, (setting, _) in cases.items()}, "LM-head step (baseline)")


if __name__ == "__main__":
    main()
