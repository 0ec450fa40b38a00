"""Independent reference implementations the tests compare against (float64, written out
from the papers' formulas, sharing no code with the package)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def agg_output_grad(h, W, targets, appearance, alpha, gated):
    """Reference: gradient into W of the z1/z2 logits of the AGG three-logit construction
    (docs/methods.md §1.3-1.4), float64; gated=False gives the plain (MLE) output-side gradient."""
    valid = targets != -100
    h, y = h[valid].double(), targets[valid]
    Wp = W.detach().double().clone().requires_grad_(True)
    z = h @ Wp.T
    if gated:
        a = appearance.double()
        rare = a < alpha
        g1 = torch.where(rare, a, torch.ones_like(a))
        mean_rare = a[rare].mean() if rare.any() else torch.tensor(0.0, dtype=torch.float64)
        g2 = torch.where(rare, torch.clamp(a / (mean_rare + 1e-7), max=1.0), torch.ones_like(a))
        gate = torch.where(rare[y][:, None], g2[None, :], g1[None, :]).clone()
        gate[torch.arange(len(y)), y] = 1.0
        z = gate * z + (1 - gate) * z.detach()
    (F.cross_entropy(z, y, reduction="sum") / len(y)).backward()
    return Wp.grad


def agg_first_step_grad(mle_grad, hidden, weight, labels, alpha, vocab):
    """Reference gradient of a tied embedding/head W after AGG's first step, from the plain
    (MLE) run's gradient of the same batch: the output-side part of the MLE gradient replaced by
    the gated one (the input-lookup part is unchanged by AGG). At step 1 (window K >= 1) the
    appearance a_k is the count of k among this step's targets; `labels` are the model's
    unshifted labels, the targets their causal shift."""
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1).reshape(-1)
    counts = torch.bincount(targets[targets != -100], minlength=vocab).double()
    h = hidden.reshape(-1, hidden.shape[-1])
    return (
        mle_grad.double()
        - agg_output_grad(h, weight, targets, counts, alpha, gated=False)
        + agg_output_grad(h, weight, targets, counts, alpha, gated=True)
    )


def regularizer_grad(method, weight, *, margin=0.5, gamma=0.75):
    """Reference gradient (float64, autograd through the explicit formula) of the unweighted
    regularizers, all rows nonzero and none excluded, N = V:
    cosreg 1/N² Σ_{i≠j} cos(w_i, w_j) (Gao et al. 2019); hinge 1/N² Σ_{i≠j} max(0, cos − γ);
    spectrum (polynomial prior, c1 = σ_1 of `weight`) Σ_k (σ_k − c1·k^−γ)² (Wang et al. 2020)."""
    w = weight.detach().double().clone().requires_grad_(True)
    n = w.shape[0]
    if method in ("cosreg", "hinge"):
        u = w / w.norm(dim=1, keepdim=True)
        cos = u @ u.T
        off = ~torch.eye(n, dtype=torch.bool)
        pairs = cos[off] if method == "cosreg" else (cos[off] - margin).clamp_min(0)
        r = pairs.sum() / n**2
    elif method == "spectrum":
        sigma = torch.linalg.svdvals(w)
        k = torch.arange(1, len(sigma) + 1, dtype=torch.float64)
        r = ((sigma - sigma[0].detach() * k ** (-gamma)) ** 2).sum()
    else:
        raise ValueError(method)
    r.backward()
    return w.grad
