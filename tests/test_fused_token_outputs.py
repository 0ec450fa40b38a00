"""The token outputs of `fused_linear_cross_entropy` (TRL's ``FusedCausalLMOutput`` fields,
Liger-Kernel's ``return_token_accuracy`` / ``return_predicted_tokens``, Cut Cross-Entropy's
``return_lse``) over every tiling, with a logit transform and AGG's gates, against float64
references written from the explicit logits: logsumexp, −Σ p log p, log Σ p², the mean logit,
``argmax`` (its first maximum). The per-token loss's gradient, weighted per token as TRL's DFT
loss weighs it, is autograd's through ``F.cross_entropy`` (the three-logit AGG construction with
gates)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aniso_plugins import FusedCrossEntropyOutput, LogitTransform, agg_gates, fused_linear_cross_entropy
from test_agg import IGN, make_case, rel_err, three_logit_loss
from test_fused_loss_tiles import TILINGS, _data

EVERY = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
FLAGS = dict(return_lse=True, return_token_accuracy=True, return_predicted_tokens=True, token_outputs=EVERY)


def _expected(z: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    logp = z.log_softmax(-1)
    p = logp.exp()
    valid = y != IGN
    top1 = (z.argmax(-1) == y) & valid
    return {
        "lse": z.logsumexp(-1), "entropy": -(p * logp).sum(-1), "log_sum_sq_probs": p.square().sum(-1).log(),
        "mean_logits": z.mean(-1), "is_top1": top1, "predicted_tokens": torch.where(valid, z.argmax(-1), -1),
        "token_accuracy": top1.sum() / valid.sum(),
    }


@pytest.mark.parametrize("transform", [None, LogitTransform(0.7, 4.0), LogitTransform(2.0)], ids=["plain", "softcap", "scale"])
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("tiling", list(TILINGS))
def test_every_token_output_equals_float64_over_every_tiling(tiling, reduction, transform):
    h, w, b, y, _, _ = _data(2)
    rows, cols = TILINGS[tiling]
    out = fused_linear_cross_entropy(h, w, y, bias=b, reduction=reduction, chunk_size=rows, vocab_chunk_size=cols,
                                     logit_transform=transform, **FLAGS)
    assert isinstance(out, FusedCrossEntropyOutput)
    z = F.linear(h, w, b)
    z = z if transform is None else transform(z)
    want = _expected(z, y)
    ce = F.cross_entropy(z, y, ignore_index=IGN, reduction=reduction)
    torch.testing.assert_close(out.loss, ce, rtol=1e-12, atol=1e-12)
    for name in ("lse", "entropy", "log_sum_sq_probs", "mean_logits"):
        torch.testing.assert_close(getattr(out, name), want[name], rtol=1e-12, atol=1e-12, msg=name)
        assert not getattr(out, name).requires_grad
    assert torch.equal(out.is_top1, want["is_top1"]) and torch.equal(out.predicted_tokens, want["predicted_tokens"])
    accuracy = want["token_accuracy"] if reduction != "none" else want["is_top1"].double()
    torch.testing.assert_close(out.token_accuracy, accuracy.to(out.token_accuracy.dtype))


def test_ties_pick_the_first_maximum_and_hits_count_it():
    """Two ids share the maximal logit: the prediction is the first (``argmax``), so a target at
    the second is no top-1 hit (TRL's and Liger's rule), across vocabulary blocks too."""
    h = torch.eye(4, dtype=torch.float64)[:2]
    w = torch.zeros(9, 4, dtype=torch.float64)
    w[2, 0] = w[7, 0] = 5.0  # row 0: ids 2 and 7 tie
    w[6, 1] = 5.0  # row 1: id 6 alone
    y = torch.tensor([7, 6])
    for cols in (None, 3, 1):
        out = fused_linear_cross_entropy(h, w, y, vocab_chunk_size=cols, return_predicted_tokens=True, token_outputs=("is_top1",))
        assert out.predicted_tokens.tolist() == [2, 6] and out.is_top1.tolist() == [False, True], cols


@pytest.mark.parametrize("tiling", ["one_tile", "vocab_blocks", "row_chunks"])
def test_per_token_loss_with_agg_gates_weighted_per_token_equals_the_three_logit_reference(tiling):
    """``reduction="none"`` with AGG's gates under a per-token upstream gradient (TRL's DFT loss
    weighs each token): dX and the gated dW equal the official construction's, token by token."""
    h, W, b, y, a = make_case(dtype=torch.float64, rare_share=0.3)
    gates = agg_gates(a, 0.3)
    h.requires_grad_(True), W.requires_grad_(True)
    upstream = torch.linspace(0.2, 1.7, y.numel(), dtype=torch.float64)
    rows, cols = TILINGS[tiling]
    out = fused_linear_cross_entropy(h, W, y, gates, reduction="none", chunk_size=rows, vocab_chunk_size=cols,
                                     token_outputs=("entropy",))
    got = torch.autograd.grad((out.loss * upstream).sum(), (h, W))
    # the official construction, one token at a time (its loss sums the rows over the valid count)
    valid = (y != IGN).nonzero().flatten()
    want = [torch.zeros_like(h), torch.zeros_like(W)]
    for i in valid.tolist():
        keep = torch.full_like(y, IGN)
        keep[i] = y[i]
        grads = torch.autograd.grad(three_logit_loss(h, W, keep, gates), (h, W))
        for acc, g in zip(want, grads):
            acc.add_(g * upstream[i])
    for g, r in zip(got, want):
        assert rel_err(g, r) < 1e-12


def test_bf16_autocast_outputs_follow_the_float32_logits():
    h, w, b, y, _, _ = _data(3, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_linear_cross_entropy(h, w, y, bias=b, reduction="none", **FLAGS)
    z = F.linear(h.bfloat16(), w.bfloat16(), b.bfloat16()).double()  # the bf16 GEMM's logits, read in float64
    want = _expected(z, y)
    for name in ("lse", "entropy", "log_sum_sq_probs", "mean_logits"):
        assert getattr(out, name).dtype == torch.float32
        torch.testing.assert_close(getattr(out, name).double(), want[name], rtol=2e-2, atol=2e-2, msg=name)


def test_token_outputs_compile_whole_and_equal_eager():
    h, w, b, y, _, _ = _data(4, dtype=torch.float32)

    def fn(h, w):
        out = fused_linear_cross_entropy(h, w, y, reduction="none", token_outputs=EVERY, return_lse=True)
        return out.loss.sum() + out.entropy.sum() + out.lse.sum() + out.is_top1.sum()

    explained = torch._dynamo.explain(fn)(h, w)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    torch._dynamo.reset()
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(h, w)
    torch._dynamo.reset()
    torch.testing.assert_close(got, fn(h, w))


def test_bad_names_and_a_shard_are_refused_with_the_fix():
    h, w, b, y, _, _ = _data(5)
    with pytest.raises(ValueError, match="token_outputs='entropy'"):
        fused_linear_cross_entropy(h, w, y, token_outputs="entropy")
    with pytest.raises(ValueError, match="among"):
        fused_linear_cross_entropy(h, w, y, token_outputs=("perplexity",))


@pytest.mark.parametrize("n, v, rows", [(2048, 151936, 256), (2048, 50257, 1024), (300, 32768, 256), (64, 262144, None),
                                        (100000, 151936, 512)])
def test_a_per_token_call_takes_whole_rows_within_trls_tile(n, v, rows):
    """The head answering TRL's fused call holds at most TRL's tile of logits (4096 tokens × 32768
    ids, or its N tokens × 32768 below 4096): the largest power of two of whole rows that fits,
    or the default plan where fewer than 64 rows would."""
    from aniso_plugins.methods.fused_loss.head import token_tile_rows

    assert token_tile_rows(n, v) == rows
    if rows is not None:
        assert rows * v <= min(n, 4096) * 32768 < 2 * rows * v or rows == 1024
