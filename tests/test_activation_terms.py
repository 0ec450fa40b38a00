"""The core's contract for activation-dependent loss terms (`aniso_activation_loss_terms`):
each rank returns its share, and the parameters receive the gradient of the sum of the shares
over micro-batches and ranks, through the head's forward hook or the adapter's explicit call
(torchtitan's chunked loss), under DDP averaging and under summed gradients; label-free
batches train on the supplied loss. References: the explicit loss written out in each test,
differentiated by autograd in float64."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from aniso_plugins import AnisoConfig, ConfigError, ModelHandle, SetupError, TrainingSession
from aniso_plugins.core.hookspecs import hookimpl
from dist_utils import run_distributed

V, D = 11, 4


class SquaredNorm:
    """A third-party term: ½‖h‖² over the valid positions, a per-micro-batch mean share."""

    name = "squared_norm"

    @hookimpl
    def aniso_activation_loss_terms(self, hidden, targets, step):
        valid = (targets != -100).unsqueeze(-1)
        return {"sq": 0.5 * (hidden * valid).square().sum() / step.accumulation_steps}


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.emb = nn.Embedding(V, D)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def hidden(self, x):
        return self.mix(self.emb(x))

    def forward(self, x):
        return self.head(self.hidden(x))


def _batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, V, (2, 5), generator=g)
        y = torch.randint(0, V, (2, 5), generator=g)
        y[0, -1] = -100
        out.append((x, y))
    return out


def _ce(logits, y):
    return nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1), ignore_index=-100)


def _reference_grads(model: Tiny, batches, weight_of_term: float = 1.0):
    """float64: Σ_m [CE_m / A + ½‖h_m ⊙ valid‖² / A] (the trainer's mean over micro-batches)."""
    ref = Tiny().double()
    ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    A = len(batches)
    for x, y in batches:
        h = ref.hidden(x)
        valid = (y != -100).unsqueeze(-1)
        (_ce(ref.head(h), y) / A + weight_of_term * 0.5 * (h * valid).square().sum() / A).backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def _session(model: Tiny, **config) -> TrainingSession:
    s = TrainingSession(AnisoConfig(metrics=(), load_entry_points=False, **config), [SquaredNorm()])
    s.setup(ModelHandle(model, head="head"))
    return s


@pytest.mark.parametrize("via", ["head_hook", "attach_call"])
def test_shares_of_every_micro_batch_reach_the_gradient_once(via):
    model = Tiny()
    batches = _batches(2)
    session = _session(model)
    session.begin_training(accumulation_steps=2)
    for m, (x, y) in enumerate(batches):
        session.begin_micro_batch(y, step=1, accumulation_steps=2, head_calls=1 if via == "head_hook" else 2)
        if via == "head_hook":
            logits = model(x)
        else:  # torchtitan: terms on the whole micro-batch, then the head on two chunks
            h = session.attach_activation_terms(model.hidden(x))
            logits = torch.cat([model.head(c) for c in h.chunk(2, dim=1)], dim=1)
        (_ce(logits, y) / 2).backward()
    session.end_step(1)
    ref = _reference_grads(model, batches)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref[name], rtol=1e-5, atol=1e-6, msg=name)
    # the logged value is the sum of the shares: the mean over micro-batches of ½‖h‖²
    with torch.no_grad():
        expected = sum(0.5 * (model.hidden(x) * (y != -100).unsqueeze(-1)).square().sum().item() for x, y in batches) / 2
    assert session.measure(1)["aniso/loss/sq"] == pytest.approx(expected, rel=1e-5)


def test_a_chunked_head_without_the_attach_call_is_refused():
    model = Tiny()
    session = _session(model)
    session.begin_training()
    x, y = _batches(1)[0]
    session.begin_micro_batch(y, step=1, head_calls=2)
    with pytest.raises(SetupError, match="attach_activation_terms"):
        model(x)


def test_terms_are_not_computed_outside_training_or_without_grad():
    model = Tiny()
    session = _session(model)
    session.begin_training()
    x, y = _batches(1)[0]
    session.begin_micro_batch(y, step=1)
    with torch.no_grad():
        model(x)
    model.eval()
    model(x).sum().backward()
    assert model.mix.weight.grad.abs().sum() > 0  # the CE path only: compare with a clean model
    clean = Tiny()
    clean.eval()
    clean(x).sum().backward()
    torch.testing.assert_close(model.mix.weight.grad, clean.mix.weight.grad)


def test_supplied_loss_trains_a_label_free_batch_on_the_terms_alone():
    class SquaredNormAsSimCSE(SquaredNorm):  # a term under a configuration that may supply the loss
        pass

    model = Tiny()
    session = TrainingSession(AnisoConfig(method="simcse", metrics=(), load_entry_points=False), [SquaredNormAsSimCSE()])
    session.plugins.pm.unregister(session.plugins.get("simcse"))  # keep only the explicit term
    session.setup(ModelHandle(model, head="head"))
    session.begin_training()
    x, _ = _batches(1)[0]
    targets = torch.full_like(x, -100)
    targets[:, :3] = 0  # the term's valid positions
    session.begin_micro_batch(targets, step=1, supplies_loss=True)
    model(x)
    loss = session.supplied_loss()
    loss.backward()
    ref = Tiny().double()
    ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    h = ref.hidden(x)
    expected = 0.5 * (h * (targets != -100).unsqueeze(-1)).square().sum()
    expected.backward()
    assert float(loss) == pytest.approx(float(expected.detach()), rel=1e-5)
    torch.testing.assert_close(model.mix.weight.grad.double(), ref.mix.weight.grad, rtol=1e-5, atol=1e-6)
    assert model.head.weight.grad is None  # the head's output reached no loss
    with pytest.raises(SetupError, match="supplied_loss"):
        session.supplied_loss()  # taken once


def test_a_label_free_batch_is_refused_unless_a_method_supplies_the_loss():
    session = _session(Tiny(), method="cosreg")
    session.begin_training()
    with pytest.raises(ConfigError, match="without labels"):
        session.begin_micro_batch(torch.zeros(2, 5, dtype=torch.long), step=1, supplies_loss=True)


def test_two_plugins_returning_one_term_name_is_a_config_error():
    class Again(SquaredNorm):
        name = "again"

    model = Tiny()
    session = TrainingSession(AnisoConfig(metrics=(), load_entry_points=False), [SquaredNorm(), Again()])
    session.setup(ModelHandle(model, head="head"))
    session.begin_training()
    x, y = _batches(1)[0]
    session.begin_micro_batch(y, step=1)
    with pytest.raises(ConfigError, match="'sq'"):
        model(x)


# --- two ranks ---------------------------------------------------------------------------------
def _two_ranks(rank: int, world: int, reduction: str):
    torch.manual_seed(0)
    model = Tiny()
    batches = _batches(4, seed=1)  # micro-batches (step 1: 0, 1 on rank 0 and 2, 3 on rank 1)
    mine = batches[2 * rank : 2 * rank + 2]
    if reduction == "ddp":  # gradients averaged over ranks
        net = nn.parallel.DistributedDataParallel(model)
        session = _session(model)
        session.begin_training(accumulation_steps=2)
    else:  # torchtitan: gradients summed over ranks, weight terms scaled by 1/world
        net = model
        session = _session(model)
        session.begin_training(accumulation_steps=2, loss_scale=1.0 / world)
    for m, (x, y) in enumerate(mine):
        session.begin_micro_batch(y, step=1, accumulation_steps=2)
        ctx = net.no_sync() if reduction == "ddp" and m == 0 else torch.enable_grad()
        with ctx:
            loss = _ce(net(x), y) / 2
            (loss if reduction == "ddp" else loss / world).backward()
    if reduction == "sum":
        for p in model.parameters():
            dist.all_reduce(p.grad)
    session.end_step(1)
    logged = session.measure(1)["aniso/loss/sq"]
    return {n: p.grad.clone() for n, p in model.named_parameters()}, logged, batches


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["ddp", "sum"])
def test_shares_sum_over_ranks_under_averaged_and_summed_gradients(reduction):
    results = run_distributed(_two_ranks, reduction)
    grads, logged, batches = results[0]
    model = Tiny()
    # the step's objective: mean over ranks of each rank's mean CE, plus the SUM of the shares
    ref = Tiny().double()
    ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    total_term = 0.0
    for x, y in batches:
        h = ref.hidden(x)
        term = 0.5 * (h * (y != -100).unsqueeze(-1)).square().sum() / 2
        (_ce(ref.head(h), y) / 4 + term).backward()
        total_term += float(term)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].double(), p.grad, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(results[1][0][name], grads[name])  # identical on both ranks
    assert logged == pytest.approx(total_term, rel=1e-5) and results[1][1] == logged
