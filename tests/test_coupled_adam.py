"""Coupled Adam (`aniso_plugins.methods.coupled_adam`) against the update written out here from the
paper's formula in float64 (Stollenwerk & Stollenwerk 2025; docs/methods.md §17), through a real
`torch.optim.AdamW` / `Adam` whose other parameters must stay exactly torch's; resume from the
optimizer's state_dict; fp16 loss scaling with the fused kernel; the refusals."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from aniso_plugins import AnisoConfig, ConfigError, ParallelLayout, SetupError, TrainingSession
from aniso_plugins.methods.coupled_adam.update import CoupledAdam

V, H = 12, 5


class Reference:
    """Coupled Adam for E and AdamW for b, in numpy float64, from the formula."""

    def __init__(self, e, b, lr, betas, eps, wd, decay_embedding, decoupled=True, scale=1.0):
        self.e, self.b = e.copy(), b.copy()
        self.me, self.ve = np.zeros_like(e), np.zeros_like(e)
        self.mb, self.vb = np.zeros_like(b), np.zeros_like(b)
        self.lr, self.betas, self.eps, self.wd, self.decay, self.decoupled, self.scale = lr, betas, eps, wd, decay_embedding, decoupled, scale
        self.t = 0

    def step(self, ge, gb):
        b1, b2 = self.betas
        self.t += 1
        c1, c2 = 1 - b1**self.t, 1 - b2**self.t
        wd_e = self.wd if self.decay else 0.0
        if wd_e and not self.decoupled:
            ge = ge + wd_e * self.e
        if wd_e and self.decoupled:
            self.e = self.e * (1 - self.lr * wd_e)
        self.me = b1 * self.me + (1 - b1) * ge
        self.ve = b2 * self.ve + (1 - b2) * ge**2
        vbar = self.scale * self.ve.mean(axis=0, keepdims=True)  # (1, H): shared by every row
        self.e = self.e - self.lr * (self.me / c1) / (np.sqrt(vbar / c2) + self.eps)
        # b: plain AdamW (torch's group weight decay, decoupled)
        self.b = self.b * (1 - self.lr * self.wd)
        self.mb = b1 * self.mb + (1 - b1) * gb
        self.vb = b2 * self.vb + (1 - b2) * gb**2
        self.b = self.b - self.lr * (self.mb / c1) / (np.sqrt(self.vb / c2) + self.eps)


def _grads(steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ge = torch.randn(V, H, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3.0, V, dtype=torch.float64)[:, None]
        ge[3] = 0.0  # a row without gradient (a token absent from every batch): its m and v only decay
        out.append((ge, torch.randn(H, generator=g, dtype=torch.float64)))
    return out


def _params(seed=1):
    g = torch.Generator().manual_seed(seed)
    e = torch.nn.Parameter(torch.randn(V, H, generator=g, dtype=torch.float64))
    b = torch.nn.Parameter(torch.randn(H, generator=g, dtype=torch.float64))
    return e, b


def _run(optimizer, e, b, grads):
    for ge, gb in grads:
        e.grad, b.grad = ge.clone(), gb.clone()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("wd, decay", [(0.0, False), (0.1, False), (0.1, True)])
@pytest.mark.parametrize("foreach", [False, True])
def test_update_equals_the_formula(wd, decay, foreach):
    e, b = _params()
    ref = Reference(e.detach().numpy(), b.detach().numpy(), 1e-2, (0.9, 0.95), 1e-8, wd, decay)
    opt = torch.optim.AdamW([e, b], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd, foreach=foreach)
    CoupledAdam(opt, [e], decay=decay)
    grads = _grads(6)
    _run(opt, e, b, grads)
    for ge, gb in grads:
        ref.step(ge.numpy(), gb.numpy())
    np.testing.assert_allclose(e.detach().numpy(), ref.e, rtol=0, atol=1e-12)
    np.testing.assert_allclose(b.detach().numpy(), ref.b, rtol=0, atol=1e-12)
    assert float(opt.state[e]["step"]) == 6 and len(opt.param_groups[0]["params"]) == 2


def test_adam_l2_decay_and_scale():
    """torch.optim.Adam: its L2 weight decay (added to the gradient) on E when decay is on; s = 2."""
    e, b = _params()
    ref = Reference(e.detach().numpy(), b.detach().numpy(), 3e-3, (0.8, 0.99), 1e-6, 0.05, True, decoupled=False, scale=2.0)
    opt = torch.optim.Adam([e], lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
    CoupledAdam(opt, [e], decay=True, scale=2.0)
    grads = _grads(4, seed=3)
    for ge, _ in grads:
        e.grad = ge.clone()
        opt.step()
        ref.step(ge.numpy(), np.zeros(H))
    np.testing.assert_allclose(e.detach().numpy(), ref.e, rtol=0, atol=1e-12)


def test_resume_from_the_optimizer_state_dict_is_exact():
    grads = _grads(7, seed=5)
    e, b = _params()
    opt = torch.optim.AdamW([e, b], lr=1e-2)
    CoupledAdam(opt, [e])
    _run(opt, e, b, grads)
    e1, b1 = _params()
    opt1 = torch.optim.AdamW([e1, b1], lr=1e-2)
    coupled = CoupledAdam(opt1, [e1])
    _run(opt1, e1, b1, grads[:4])
    saved, weights = copy.deepcopy(opt1.state_dict()), (e1.detach().clone(), b1.detach().clone())
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}  # E's state, under Adam's names
    coupled.remove()
    e2, b2 = (torch.nn.Parameter(w.clone()) for w in weights)
    opt2 = torch.optim.AdamW([e2, b2], lr=1e-2)
    opt2.load_state_dict(saved)
    CoupledAdam(opt2, [e2])
    _run(opt2, e2, b2, grads[4:])
    assert torch.equal(e2, e) and torch.equal(b2, b)


def test_differs_from_adamw():
    """The test above would pass for plain AdamW if the hooks did nothing: they do not."""
    grads = _grads(3)
    e, b = _params()
    opt = torch.optim.AdamW([e, b], lr=1e-2)
    _run(opt, e, b, grads)
    e1, b1 = _params()
    opt1 = torch.optim.AdamW([e1, b1], lr=1e-2)
    CoupledAdam(opt1, [e1])
    _run(opt1, e1, b1, grads)
    assert (e - e1).abs().max() > 1e-3 and torch.equal(b, b1)


def test_fused_kernel_loss_scaling_skips_an_overflowing_step():
    """fp16 loss scaling with fused AdamW: the scaler hands the optimizer grad_scale / found_inf,
    which Coupled Adam honours on the device as the fused kernel does (no change on overflow)."""
    e, b = (torch.nn.Parameter(p.detach().float()) for p in _params())
    opt = torch.optim.AdamW([e, b], lr=1e-2, fused=True)
    CoupledAdam(opt, [e])
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    ref_e = e.detach().clone()
    ref = Reference(ref_e.double().numpy(), b.detach().double().numpy(), 1e-2, (0.9, 0.999), 1e-8, 0.01, False)
    for i, (ge, gb) in enumerate(_grads(3, seed=7)):
        ge = ge.float()
        if i == 1:
            ge[0, 0] = float("inf")
        scaler.scale((e * ge).sum() + (b * gb.float()).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if i != 1:
            ref.step(ge.double().numpy(), gb.numpy())
    np.testing.assert_allclose(e.detach().double().numpy(), ref.e, rtol=0, atol=2e-6)
    assert float(opt.state[e]["step"]) == 2


def test_refusals():
    e, b = _params()
    with pytest.raises(ConfigError, match="SGD"):
        CoupledAdam(torch.optim.SGD([e, b], lr=0.1), [e])
    with pytest.raises(ConfigError, match="amsgrad"):
        CoupledAdam(torch.optim.AdamW([e, b], amsgrad=True), [e])
    with pytest.raises(ConfigError, match="no group"):
        CoupledAdam(torch.optim.AdamW([b]), [e])
    session = TrainingSession(AnisoConfig(method="coupled_adam"))
    with pytest.raises(SetupError, match="DeepSpeed"):
        session.check_layout(ParallelLayout(optimizer_flat="DeepSpeed's ZeRO optimizer steps flat partitions"))
    with pytest.raises(SetupError, match="pipeline"):
        session.check_layout(ParallelLayout(pipeline_stages=2))
