"""SimCTG's token contrastive loss (Su et al. 2022, docs/methods.md §12): the blockwise op
against an explicit float64 loop over sequences × i × j≠i, its memory bound, the plugin's
shares, the gradient of the first optimizer step through the real HF and Lightning Trainers
(and the torchtitan adapter's attach path), exactness over 2 gloo ranks under DDP and FSDP2
(pooled over the union batch), and the effect on a tiny LM's hidden-state cosine."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aniso_plugins import AnisoConfig, AnisoPlugins, ModelHandle, StepInfo, TrainingSession, causal_targets
from aniso_plugins.methods.simctg.loss import simctg_loss, simctg_pair_count, simctg_pair_sums
from dist_utils import run_distributed
from device_discipline import LargestTensor
from token_data import TokenDataset

IGNORE = -100
# transformers and lightning are imported inside the tests that use them: the 2-rank workers
# import this module, and should not pay for them


# --- the reference: explicit loops, float64 ----------------------------------------------------


def ref_pair_sums(hidden: torch.Tensor, valid: torch.Tensor, margin: float) -> tuple[torch.Tensor, int]:
    """Σ_b Σ_i Σ_{j≠i} max(0, ρ − 1 + cos(h_bi, h_bj)) over valid positions, and the pair count."""
    t, d = hidden.shape[-2:]
    h, valid = hidden.reshape(-1, t, d).double(), valid.reshape(-1, t)
    total, count = h.new_zeros(()), 0
    for b in range(h.shape[0]):
        for i in range(t):
            for j in range(t):
                if i != j and valid[b, i] and valid[b, j]:
                    cos = h[b, i].dot(h[b, j]) / (h[b, i].norm() * h[b, j].norm())
                    total = total + torch.clamp(margin - 1.0 + cos, min=0.0)
                    count += 1
    return total, count


def ref_step_loss(hiddens, targets, margin: float, weight: float) -> torch.Tensor:
    """weight · mean over the step's micro-batches of each micro-batch's pooled L_CL."""
    losses = []
    for h, y in zip(hiddens, targets):
        total, count = ref_pair_sums(h, y != IGNORE, margin)
        losses.append(total / count)
    return weight * sum(losses) / len(losses)


def per_sequence_mean(hidden, targets, margin):
    """The other normalisation (mean over sequences of per-sequence means), to show the tests
    can tell it from the pooled one."""
    means = []
    for h, y in zip(hidden, targets):
        total, count = ref_pair_sums(h[None], (y != IGNORE)[None], margin)
        means.append(total / count)
    return sum(means) / len(means)


def _hidden(b=3, t=7, d=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, t, d, generator=g, dtype=torch.float64) + 0.35).to(dtype)


def _valid(b=3, t=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    valid = torch.rand(b, t, generator=g) > 0.3
    valid[0, :] = True
    valid[1, 1:] = False  # one valid position: no pair
    return valid


# --- the op -----------------------------------------------------------------------------------


@pytest.mark.parametrize("margin", [0.5, 1.2])
@pytest.mark.parametrize("block", [1, 3, 7, 50])
def test_value_and_gradient_equal_the_explicit_loop(block, margin):
    h, valid = _hidden(), _valid()
    x = h.clone().requires_grad_(True)
    total, count = simctg_pair_sums(x, valid, margin, block)
    loss = simctg_loss(x, valid, margin, block)
    (grad,) = torch.autograd.grad(loss, x)

    y = h.clone().requires_grad_(True)
    ref_total, ref_count = ref_pair_sums(y, valid, margin)
    (ref_grad,) = torch.autograd.grad(ref_total / ref_count, y)

    assert total.dtype == loss.dtype == torch.float64 and loss.dim() == 0
    assert int(count) == ref_count == int(simctg_pair_count(valid)) > 0
    torch.testing.assert_close(total.detach(), ref_total.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(loss.detach(), (ref_total / ref_count).detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)
    assert grad[~valid].abs().max() == 0 and grad[1].abs().max() == 0  # no pair, no gradient
    # both sides of the hinge occur, so the mask of active pairs matters
    u = F.normalize(h, dim=-1)
    cos = (u @ u.transpose(1, 2))[valid[:, :, None] & valid[:, None, :] & ~torch.eye(7, dtype=torch.bool)]
    assert ((cos > 1 - margin).sum() > 3) and ((cos < 1 - margin).sum() > 3)


def test_packed_rows_pair_only_within_each_example():
    """Segments (a packed row's example ids) give exactly the loss of the examples as rows of their
    own: pairs never cross examples, the count is Σ over examples of n(n − 1)."""
    h, valid = _hidden(), _valid()
    segments = torch.tensor([0, 0, 0, 1, 1, 2, 2]).expand(h.shape[:-1])
    x = h.clone().requires_grad_(True)
    loss = simctg_loss(x, valid, 0.5, 2, segments=segments)
    (grad,) = torch.autograd.grad(loss, x)
    y = h.clone().requires_grad_(True)
    total, count = h.new_zeros((), dtype=torch.float64), 0
    for lo, hi in ((0, 3), (3, 5), (5, 7)):  # each example as its own rows
        t, c = ref_pair_sums(y[..., lo:hi, :], valid[..., lo:hi], 0.5)
        total, count = total + t, count + c
    (ref_grad,) = torch.autograd.grad(total / count, y)
    assert int(simctg_pair_count(valid, segments)) == count < int(simctg_pair_count(valid))
    torch.testing.assert_close(loss.detach(), (total / count).detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)


def test_leading_dimensions_and_zero_vectors():
    h, valid = _hidden(b=6), _valid(b=6)
    h[2, 3] = 0.0  # a zero hidden state at a valid position: cosine 0 with every other, no NaN
    valid[2, 3] = True
    x = h.clone().requires_grad_(True)
    flat = simctg_loss(x, valid, 0.5, 2)
    (grad,) = torch.autograd.grad(flat, x)
    shaped = simctg_loss(h.view(2, 3, 7, 5), valid.view(2, 3, 7), 0.5, 2)
    torch.testing.assert_close(shaped, flat.detach(), rtol=1e-14, atol=0)
    assert torch.isfinite(grad).all() and grad[2, 3].abs().max() == 0
    keep = valid.clone()
    keep[2, 3] = False  # a zero vector's pairs add nothing to the sum (max(0, ρ − 1 + 0) = 0) but count
    ref_total, ref_count = ref_pair_sums(h, keep, 0.5)
    torch.testing.assert_close(flat.detach(), ref_total / (ref_count + 2 * int(keep[2].sum())), rtol=1e-12, atol=0)


def test_no_pairs_gives_a_zero_connected_to_the_input():
    x = _hidden().requires_grad_(True)
    loss = simctg_loss(x, torch.zeros(3, 7, dtype=torch.bool))
    (grad,) = torch.autograd.grad(loss, x)
    assert float(loss.detach()) == 0.0 and grad.abs().max() == 0


def test_bf16_input_is_computed_in_float32():
    h = _hidden(b=2, t=24, d=32, seed=3, dtype=torch.bfloat16)
    valid = _valid(b=2, t=24, seed=4)
    x = h.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast would run bmm in bf16
        loss = simctg_loss(x, valid, 0.5, block=5)
    loss.backward()
    loss = loss.detach()
    y = h.double().requires_grad_(True)  # the same bf16 values, upcast
    ref_total, ref_count = ref_pair_sums(y, valid, 0.5)
    ref = ref_total / ref_count
    ref.backward()
    ref = ref.detach()
    assert x.grad.dtype == torch.bfloat16
    assert abs(loss.item() - ref.item()) <= 2e-6 * ref.item()  # bf16 cosines would err by ~1e-3
    torch.testing.assert_close(x.grad.double(), y.grad, rtol=2e-2, atol=1e-4)  # the gradient is rounded to bf16


def test_memory_is_batch_times_length_times_block():
    b, t, d, block = 2, 96, 8, 8
    x = torch.randn(b, t, d).requires_grad_(True)
    valid = torch.ones(b, t, dtype=torch.bool)
    with LargestTensor() as probe:
        simctg_loss(x, valid, 0.5, block).backward()
    assert probe.largest <= max(b * t * block, b * t * d) < b * t * t // 4


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="same leading shape"):
        simctg_pair_sums(torch.randn(2, 5, 3), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool mask"):
        simctg_pair_sums(torch.randn(2, 5, 3), torch.ones(2, 5))
    with pytest.raises(ValueError, match="block=0"):
        simctg_pair_sums(torch.randn(2, 5, 3), torch.ones(2, 5, dtype=torch.bool), block=0)


# --- the plugin -------------------------------------------------------------------------------


def _config(**kw):
    return AnisoConfig(**{"method": "simctg", "metrics": (), "load_entry_points": False, **kw})


def test_plugin_share_is_weighted_pooled_loss_over_accumulation_steps():
    plugins = AnisoPlugins(_config(simctg_weight=0.7, simctg_margin=0.8, simctg_block=2))
    h, valid = _hidden(), _valid()
    targets = torch.where(valid, 5, IGNORE)
    step = StepInfo(step=1, micro_batch=0, accumulation_steps=3)
    plugins.targets(targets, step)
    x = h.clone().requires_grad_(True)
    share = plugins.activation_loss_terms(x, targets, step)
    total, count = ref_pair_sums(h, valid, 0.8)
    torch.testing.assert_close(share.detach(), 0.7 * total / count / 3, rtol=1e-12, atol=0)

    nothing = torch.full_like(targets, IGNORE)  # no valid pair: a zero share, differentiable
    step = StepInfo(step=1, micro_batch=1, accumulation_steps=3)
    plugins.targets(nothing, step)
    share = plugins.activation_loss_terms(x, nothing, step)
    (grad,) = torch.autograd.grad(share, x)
    assert float(share.detach()) == 0.0 and grad.abs().max() == 0


def test_plugin_refuses_misaligned_input_and_a_missing_targets_call():
    plugins = AnisoPlugins(_config())
    step = StepInfo(step=1)
    with pytest.raises(RuntimeError, match="begin_micro_batch"):
        plugins.activation_loss_terms(torch.randn(2, 5, 3), torch.zeros(2, 5, dtype=torch.long), step)
    plugins.targets(torch.zeros(2, 5, dtype=torch.long), step)
    with pytest.raises(ValueError, match="not .*aligned"):
        plugins.activation_loss_terms(torch.randn(2, 4, 3), torch.zeros(2, 5, dtype=torch.long), step)


def test_combined_with_agg():
    plugins = AnisoPlugins(_config(method=("agg", "simctg")))
    assert {"agg", "simctg"} <= set(plugins.names)


# --- through the real trainers ----------------------------------------------------------------

MARGIN, WEIGHT = 1.0, 2.0  # at initialisation few cosines exceed 0.5; ρ = 1 makes about half the pairs active


class MaskedTokens(TokenDataset):
    """Labels IGNORE from a per-sequence length on (3..8 of 8): unequal valid counts per
    sequence and per micro-batch, so pooled and per-sequence normalisations differ."""

    def __getitem__(self, i):
        item = super().__getitem__(i)
        labels = item["labels"].clone()
        labels[3 + (5 * i) % 6 :] = IGNORE
        return {"input_ids": item["input_ids"], "labels": labels}


def _hf_run(tmp_path, method, capture_inputs=False):
    from transformers import Trainer, TrainingArguments

    from aniso_plugins.integrations.hf import AnisoCallback
    from hf_utils import GradCapture, tiny_gpt2

    model = tiny_gpt2()
    start = copy.deepcopy(model)
    seen = []
    if capture_inputs:
        def record(module, args, kwargs):
            if module.training:
                seen.append((kwargs["input_ids"].clone(), kwargs["labels"].clone()))

        model.register_forward_pre_hook(record, with_kwargs=True)
    cap = GradCapture()
    cfg = _config(method=method, simctg_margin=MARGIN, simctg_weight=WEIGHT, simctg_block=3)
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no", seed=0,
        data_seed=0, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1, max_grad_norm=0.0,
        learning_rate=1e-2, logging_steps=1,
    )
    trainer = Trainer(model=model, args=args, train_dataset=MaskedTokens(), callbacks=[AnisoCallback(cfg), cap])
    trainer.train()
    return start, cap.grads[0], seen, trainer.state.log_history


def test_hf_trainer_first_step_gradient_equals_reference(tmp_path):
    _, mle, _, _ = _hf_run(tmp_path, "none")
    start, got, seen, logs = _hf_run(tmp_path, "simctg", capture_inputs=True)
    assert len(seen) == 2

    params = dict(start.named_parameters())
    hiddens, targets = [], []
    for ids, labels in seen:
        out = start(input_ids=ids, output_hidden_states=True)
        hiddens.append(out.hidden_states[-1])  # after ln_f: the LM head's input
        targets.append(causal_targets(labels))
    ref = ref_step_loss(hiddens, targets, MARGIN, WEIGHT)
    ref_grads = dict(zip(params, torch.autograd.grad(ref, list(params.values()), allow_unused=True)))
    ref = float(ref.detach())

    assert set(got) == set(mle) and len(got) > 5
    checked = 0
    for name, g in got.items():
        expected = ref_grads[name]
        if expected is None:  # a parameter the hidden states do not depend on
            expected = torch.zeros_like(g, dtype=torch.float64)
        torch.testing.assert_close((g - mle[name]).double(), expected.double(), rtol=1e-5, atol=2e-7, msg=name)
        checked += expected.abs().max() > 1e-5
    assert checked >= 5  # the term reaches most parameters
    logged = next(r["aniso/loss/simctg"] for r in logs if "aniso/loss/simctg" in r)
    assert logged == pytest.approx(ref, rel=1e-6)
    with torch.no_grad():
        alternative = WEIGHT * sum(per_sequence_mean(h, y, MARGIN) for h, y in zip(hiddens, targets)) / 2
    assert abs(float(alternative) - ref) > 1e-3 * ref


def _lightning_run(tmp_path, method):
    import lightning.pytorch as pl

    from aniso_plugins.integrations.lightning import AnisoCallback
    from lightning_utils import GradCapture, LitLM

    module = LitLM()
    start = copy.deepcopy(module)
    cap = GradCapture()
    cfg = _config(method=method, simctg_margin=MARGIN, simctg_weight=WEIGHT, simctg_block=4)
    cb = AnisoCallback(cfg, head="model.lm_head", input_embedding="model.embed", blocks="model.blocks", targets="causal")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path), num_sanity_val_steps=0, accumulate_grad_batches=2,
        callbacks=[cb, cap],
    )
    loader = torch.utils.data.DataLoader(MaskedTokens(), batch_size=4)
    trainer.fit(module, loader)
    return start, cap.grads[0], list(loader)[:2]


def test_lightning_trainer_first_step_gradient_equals_reference(tmp_path):
    _, mle, _ = _lightning_run(tmp_path, "none")
    start, got, batches = _lightning_run(tmp_path, "simctg")
    hiddens = []
    start.model.lm_head.register_forward_pre_hook(lambda m, a: hiddens.append(a[0]))
    for batch in batches:
        start.model(batch["input_ids"])
    ref = ref_step_loss(hiddens, [causal_targets(b["labels"]) for b in batches], MARGIN, WEIGHT)
    params = dict(start.named_parameters())
    ref_grads = dict(zip(params, torch.autograd.grad(ref, list(params.values()), allow_unused=True)))
    checked = 0
    for name, g in got.items():
        expected = ref_grads[name]
        expected = torch.zeros_like(g) if expected is None else expected
        torch.testing.assert_close((g - mle[name]).double(), expected.double(), rtol=1e-5, atol=2e-7, msg=name)
        checked += expected.abs().max() > 1e-5
    assert checked >= 5


# --- the torchtitan adapter's path: attach on the whole micro-batch, head on chunks ------------


class CausalNet(nn.Module):
    """Embedding -> causal running mean -> tanh(Linear) -> LM head: hidden states that mix the
    prefix, in any dtype."""

    def __init__(self, vocab=23, dim=6, seed=0, dtype=torch.float64):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim, dtype=dtype)
        self.mix = nn.Linear(dim, dim, dtype=dtype)
        self.lm_head = nn.Linear(dim, vocab, bias=False, dtype=dtype)

    def hidden(self, ids):
        e = self.embed(ids)
        steps = torch.arange(1, ids.shape[1] + 1, dtype=e.dtype).unsqueeze(1)
        return torch.tanh(self.mix(e.cumsum(1) / steps))

    def forward(self, ids):
        return self.lm_head(self.hidden(ids))


def _ids_and_targets(seed, batch=3, length=6, vocab=23, ignore_from=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (batch, length), generator=g)
    labels = ids.clone()
    for b, start in enumerate(ignore_from or ()):
        labels[b, start:] = IGNORE
    return ids, causal_targets(labels)


def test_attach_path_with_chunked_head_equals_the_forward_hook_path():
    ids, targets = _ids_and_targets(5, batch=3, length=8, ignore_from=(8, 5, 3))
    cfg = _config(simctg_margin=1.0, simctg_weight=0.6, simctg_block=3)

    def grads(head_calls, method="simctg"):
        model = CausalNet()
        session = TrainingSession(cfg.replace(method=method))
        session.setup(ModelHandle(model, head="lm_head"))
        session.begin_training()
        session.begin_micro_batch(targets, step=1, head_calls=head_calls)
        if head_calls == 1:
            logits = model(ids)
        else:  # torchtitan's AnisoChunkedLoss: attach on the whole micro-batch, then the head per chunk
            hidden = session.attach_activation_terms(model.hidden(ids))
            logits = torch.cat([model.lm_head(c) for c in hidden.chunk(head_calls, dim=1)], 1)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    hook, attached, mle = grads(1), grads(2), grads(2, method="none")
    for name in hook:
        torch.testing.assert_close(attached[name], hook[name], rtol=1e-12, atol=1e-15, msg=name)
    assert (hook["mix.weight"] - mle["mix.weight"]).abs().max() > 1e-4  # the term is in both


# --- 2 gloo ranks -----------------------------------------------------------------------------

DIST = dict(simctg_margin=1.0, simctg_weight=0.7, simctg_block=2)
IGNORE_FROM = {(0, 0): (6, 4, 2), (0, 1): (5, 6, 6), (1, 0): (3, 6, 4), (1, 1): (1, 0, 1)}
"""(rank, micro-batch) -> where each sequence's labels stop; rank 1's second micro-batch has no pair."""


def _dist_step(rank, world, mode):
    """One optimizer step of 2 micro-batches on this rank's data: (logged term, full gradients)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = CausalNet()
    session = TrainingSession(_config(**DIST))
    session.setup(ModelHandle(model, head="lm_head"))
    if mode == "ddp":
        wrapper = nn.parallel.DistributedDataParallel(model)
    else:
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        wrapper = model
    session.begin_training(accumulation_steps=2)
    for m in range(2):
        ids, targets = _ids_and_targets(10 * rank + m, ignore_from=IGNORE_FROM[rank, m])
        session.begin_micro_batch(targets, step=1, accumulation_steps=2)
        sync = wrapper.no_sync() if mode == "ddp" and m == 0 else contextlib.nullcontext()
        with sync:
            (wrapper(ids) * 0).sum().backward()  # a main loss with no gradient: only the term's
    session.end_step(1)
    logged = session.measure(1)["aniso/loss/simctg"]
    grads = {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for n, p in model.named_parameters()
    }
    return logged, grads


def _dist_worker(rank, world):
    return {mode: _dist_step(rank, world, mode) for mode in ("ddp", "fsdp2")}


@pytest.mark.slow
def test_two_ranks_gradient_equals_single_process_union_batch():
    results = run_distributed(_dist_worker)
    model = CausalNet()
    hiddens, targets = [], []
    for m in range(2):  # micro-batch m of the step: both ranks' sequences, pooled
        parts = [_ids_and_targets(10 * r + m, ignore_from=IGNORE_FROM[r, m]) for r in range(2)]
        hiddens.append(model.hidden(torch.cat([p[0] for p in parts])))
        targets.append(torch.cat([p[1] for p in parts]))
    ref = ref_step_loss(hiddens, targets, DIST["simctg_margin"], DIST["simctg_weight"])
    params = dict(model.named_parameters())
    ref_grads = dict(zip(params, torch.autograd.grad(ref, list(params.values()), allow_unused=True)))
    ref = float(ref.detach())
    assert ref_grads["mix.weight"].abs().max() > 1e-3
    for rank, result in enumerate(results):
        assert set(result) == {"ddp", "fsdp2"}
        for mode, (logged, grads) in result.items():
            where = f"{mode} / rank {rank}"
            assert logged == pytest.approx(ref, rel=1e-12), where
            assert set(grads) == set(params), where
            for name, g in grads.items():
                expected = ref_grads[name] if ref_grads[name] is not None else torch.zeros_like(g)
                torch.testing.assert_close(g, expected, rtol=1e-10, atol=1e-14, msg=f"{name} / {where}")


# --- effect -----------------------------------------------------------------------------------


def _markov(n, length, vocab, seed):
    """`n` sequences (sampled with `seed`) of one random first-order Markov chain with peaked
    transitions: the next token depends on the context, so the hidden states must tell
    positions apart."""
    transitions = (3.0 * torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0))).softmax(-1)
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(n, length, dtype=torch.long)
    ids[:, 0] = torch.randint(vocab, (n,), generator=g)
    for t in range(1, length):
        ids[:, t] = torch.multinomial(transitions[ids[:, t - 1]], 1, generator=g).squeeze(1)
    return ids


def _mean_cosine(h: torch.Tensor) -> float:
    """Mean over ordered pairs i ≠ j of cos(h_i, h_j), dense float64."""
    u = h.double() / h.double().norm(dim=1, keepdim=True)
    n = len(u)
    return float(((u @ u.T).sum() - (u * u).sum()) / (n * (n - 1)))


def _train_tiny_lm(method, steps=80, batch=8, length=16, vocab=64):
    from lightning_utils import TinyLM

    torch.manual_seed(0)
    model = TinyLM(vocab=vocab, dim=16)
    session = TrainingSession(_config(method=method))  # the paper's ρ = 0.5, weight 1
    session.setup(ModelHandle(model, head="lm_head"))
    session.begin_training()
    data = _markov(steps * batch, length, vocab, seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for s in range(steps):
        ids = data[s * batch : (s + 1) * batch]
        targets = causal_targets(ids)
        session.begin_micro_batch(targets, step=s + 1)
        F.cross_entropy(model(ids).flatten(0, 1), targets.flatten()).backward()
        opt.step()
        opt.zero_grad()
        session.end_step(s + 1)
    hidden = []
    model.lm_head.register_forward_pre_hook(lambda m, a: hidden.append(a[0].detach()))
    val = _markov(16, length, vocab, seed=2)
    with torch.no_grad():
        nll = F.cross_entropy(model(val)[:, :-1].flatten(0, 1), val[:, 1:].flatten())
    return _mean_cosine(hidden[0][:, :-1].flatten(0, 1)), float(nll)  # validation tokens with a target


def test_simctg_lowers_the_hidden_state_mean_cosine():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one thread is fastest, also on a busy machine
    try:
        (mle, mle_nll), (simctg, simctg_nll) = _train_tiny_lm("none"), _train_tiny_lm("simctg")
    finally:
        torch.set_num_threads(threads)
    print(f"validation hidden-state mean cosine: MLE {mle:.4f}, SimCTG {simctg:.4f} (NLL {mle_nll:.3f}, {simctg_nll:.3f})")
    assert simctg < mle - 0.2
