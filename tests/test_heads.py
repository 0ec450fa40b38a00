"""Untied and low-rank LM heads: the low-rank head against numpy SVDs and explicit products,
merging, the head plugin, round trips of tiny transformers models (GPT-2, Llama, built from
configs, nothing downloaded) through save_pretrained / from_pretrained, and composition with
AGG."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import TrainerCallback

from aniso_plugins import AnisoConfig, AnisoPlugins, ModelHandle, RunInfo, SetupError, StepInfo
from aniso_plugins.methods.heads.lowrank import LowRankHead, merge_low_rank, merge_low_rank_heads
from aniso_plugins.models.handle import OutputEmbeddingsHandle

V, D = 40, 8


class TinyLM(nn.Module):
    def __init__(self, vocab=V, dim=D, tied=True, bias=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=bias)
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        return self.lm_head(self.embed(ids))


def _linear(vocab=V, dim=D, bias=True, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    head = nn.Linear(dim, vocab, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        head.weight.add_(0.2)
    return head


def _plugins(**config) -> AnisoPlugins:
    return AnisoPlugins(AnisoConfig(metrics=(), load_entry_points=False, **config))


# --- LowRankHead ------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [1, 3, D - 1])
def test_svd_init_is_the_best_rank_r_approximation_split_evenly(rank):
    head = _linear()
    low = LowRankHead.from_linear(head, rank)
    w = head.weight.detach().numpy()
    u, s, vt = np.linalg.svd(w, full_matrices=False)
    best = (u[:, :rank] * s[:rank]) @ vt[:rank]
    np.testing.assert_allclose(low.weight.detach().numpy(), best, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(w - best) ** 2, (s[rank:] ** 2).sum(), rtol=1e-10)  # Eckart–Young
    a, b = low.A.detach().numpy(), low.B.detach().numpy()
    np.testing.assert_allclose(a.T @ a, np.diag(s[:rank]), atol=1e-10)  # AᵀA = BBᵀ = S_r
    np.testing.assert_allclose(b @ b.T, np.diag(s[:rank]), atol=1e-10)
    assert low.A.shape == (V, rank) and low.B.shape == (rank, D)
    assert low.A.dtype == torch.float64 and low.A.requires_grad and low.B.requires_grad
    torch.testing.assert_close(low.bias, head.bias)
    assert low.bias is head.bias  # the head's own bias Parameter: a bias the model ties elsewhere stays tied (BERT)


def test_forward_is_the_linear_map_of_the_product_and_trains_both_factors():
    low = LowRankHead.from_linear(_linear(), 3)
    x = torch.randn(2, 5, D, dtype=torch.float64)
    out = low(x)
    a = low.A.detach().clone().requires_grad_(True)
    b = low.B.detach().clone().requires_grad_(True)
    c = low.bias.detach().clone().requires_grad_(True)
    ref = x @ (a @ b).T + c
    torch.testing.assert_close(out, ref)
    target = torch.randn_like(ref)
    (out * target).sum().backward()
    (ref * target).sum().backward()
    for got, want in ((low.A, a), (low.B, b), (low.bias, c)):
        torch.testing.assert_close(got.grad, want.grad)
    # `weight` is the differentiable product
    low.zero_grad()
    low.weight.sum().backward()
    torch.testing.assert_close(low.A.grad, torch.ones(V, D, dtype=torch.float64) @ low.B.detach().T)


def test_random_init_matches_the_head_scale_and_is_reproducible():
    head = _linear(vocab=2000, dim=64, bias=False)
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    low = LowRankHead.from_linear(head, 16, init="random", generator=gen())
    again = LowRankHead.from_linear(head, 16, init="random", generator=gen())
    torch.testing.assert_close(low.A, again.A)
    ratio = float(low.weight.detach().std() / head.weight.detach().std())
    assert 0.9 < ratio < 1.1, ratio
    fresh = LowRankHead(64, 2000, 16)
    ratio = float(fresh.weight.detach().std() * (3 * 64) ** 0.5)  # nn.Linear's std 1/sqrt(3d)
    assert 0.9 < ratio < 1.1, ratio
    assert fresh.bias is None and "rank=16" in repr(fresh)


@pytest.mark.parametrize(
    "head, rank, init, words",
    [
        (_linear(), D, "svd", ["rank=8", "1 <= r < d = 8"]),
        (_linear(), 0, "svd", ["rank=0"]),
        (_linear(), 2.0, "svd", ["rank=2.0"]),
        (_linear(), True, "svd", ["rank=True"]),
        (nn.Identity(), 2, "svd", ["Identity", "2-D `weight`"]),
        (_linear(), 2, "qr", ["init='qr'", "svd, random"]),
    ],
)
def test_bad_low_rank_arguments_raise_clear_errors(head, rank, init, words):
    with pytest.raises(ValueError) as info:
        LowRankHead.from_linear(head, rank, init=init)
    for word in words:
        assert word in str(info.value)


def test_merge_gives_an_ordinary_linear_with_the_product():
    low = LowRankHead.from_linear(_linear(), 2)
    with torch.no_grad():
        low.A.add_(0.1)  # no longer the SVD: the merge must use the current factors
    merged = merge_low_rank(low)
    assert type(merged) is nn.Linear and merged.weight.dtype == torch.float64
    torch.testing.assert_close(merged.weight, low.A.detach() @ low.B.detach())
    torch.testing.assert_close(merged.bias, low.bias.detach())
    x = torch.randn(3, D, dtype=torch.float64)
    torch.testing.assert_close(merged(x), low(x))
    with pytest.raises(TypeError, match="LowRankHead"):
        merge_low_rank(nn.Linear(2, 3))


def test_merge_low_rank_heads_replaces_them_in_place():
    model = TinyLM(tied=False)
    model.lm_head = LowRankHead.from_linear(model.lm_head, 3)
    product = model.lm_head.weight.detach().clone()
    assert merge_low_rank_heads(model) == ["lm_head"]
    assert type(model.lm_head) is nn.Linear
    torch.testing.assert_close(model.lm_head.weight.detach(), product)
    assert merge_low_rank_heads(model) == []
    with pytest.raises(TypeError, match="merge_low_rank\\(head\\)"):
        merge_low_rank_heads(LowRankHead(4, 5, 2))


# --- the head plugin ---------------------------------------------------------------------------


def test_untie_gives_the_head_an_independent_copy():
    model = TinyLM(tied=True)
    shared = model.embed.weight
    before = shared.detach().clone()
    _plugins(head="untie").setup(ModelHandle(model, input_embedding="embed"))
    assert model.lm_head.weight is not model.embed.weight and model.embed.weight is shared
    torch.testing.assert_close(model.lm_head.weight.detach(), before)
    model(torch.arange(6)).sum().backward()
    assert model.embed.weight.grad.abs().sum() > 0 and model.lm_head.weight.grad.abs().sum() > 0
    x = model.embed.weight.grad[6:]  # rows never looked up: only the head's gradient would reach them if tied
    assert x.abs().max() == 0


def test_untie_of_an_untied_model_is_a_no_op():
    model = TinyLM(tied=False)
    head = model.lm_head.weight
    _plugins(head="untie").setup(ModelHandle(model, input_embedding="embed"))
    assert model.lm_head.weight is head


def test_lowrank_plugin_replaces_a_tied_head_and_leaves_the_embedding():
    model = TinyLM(tied=True)
    emb = model.embed.weight.detach().clone()
    _plugins(head="lowrank", lowrank_rank=3, lowrank_init="svd").setup(ModelHandle(model, input_embedding="embed"))
    assert isinstance(model.lm_head, LowRankHead) and model.lm_head.rank == 3
    torch.testing.assert_close(model.embed.weight.detach(), emb)
    u, s, vt = np.linalg.svd(emb.double().numpy(), full_matrices=False)
    np.testing.assert_allclose(model.lm_head.weight.detach().double().numpy(), (u[:, :3] * s[:3]) @ vt[:3], atol=1e-5)


def test_lowrank_plugin_rank_not_below_d_is_a_setup_error():
    with pytest.raises(SetupError, match="lowrank_rank=8.*1 <= r < d = 8"):
        _plugins(head="lowrank", lowrank_rank=D).setup(ModelHandle(TinyLM(), input_embedding="embed"))


# --- transformers models built from configs ------------------------------------------------------


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=D, n_layer=1, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=0))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
    )
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("build", [_gpt2, _llama])
def test_hf_untie_round_trip_stays_untied(build, tmp_path):
    model = build()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    _plugins(head="untie").setup(OutputEmbeddingsHandle(model))
    assert model.config.tie_word_embeddings is False
    model.tie_weights()  # must not re-tie
    assert model.lm_head.weight is not model.get_input_embeddings().weight
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # make the two matrices differ
    head, emb = model.lm_head.weight.detach().clone(), model.get_input_embeddings().weight.detach().clone()
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    assert loaded.config.tie_word_embeddings is False
    assert loaded.lm_head.weight is not loaded.get_input_embeddings().weight
    torch.testing.assert_close(loaded.lm_head.weight.detach(), head)
    torch.testing.assert_close(loaded.get_input_embeddings().weight.detach(), emb)


@pytest.mark.parametrize("build", [_gpt2, _llama])
def test_hf_low_rank_train_merge_save_load(build, tmp_path):
    model = build()
    _plugins(head="lowrank", lowrank_rank=3).setup(OutputEmbeddingsHandle(model))
    assert isinstance(model.lm_head, LowRankHead) and model.get_output_embeddings() is model.lm_head
    assert model.config.tie_word_embeddings is False
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    a0 = model.lm_head.A.detach().clone()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert not torch.equal(model.lm_head.A.detach(), a0)  # the factors train
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        product = model.lm_head.weight.detach().clone()
    assert merge_low_rank_heads(model) == ["lm_head"]
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    assert type(loaded.lm_head) is nn.Linear and loaded.config.tie_word_embeddings is False
    assert loaded.lm_head.weight is not loaded.get_input_embeddings().weight
    torch.testing.assert_close(loaded.lm_head.weight.detach(), product)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, logits, rtol=1e-5, atol=1e-6)


def test_merge_refuses_a_model_that_would_re_tie(tmp_path):
    model = _gpt2()
    model.lm_head = LowRankHead.from_linear(model.lm_head, 2)  # by hand: config still says tied
    with pytest.raises(ValueError, match="tie_word_embeddings is True"):
        merge_low_rank_heads(model)


# --- composition with AGG ---------------------------------------------------------------------


@pytest.mark.parametrize("head", ["untie", "lowrank"])
def test_agg_gates_the_replaced_head(head):
    model = TinyLM(tied=True)
    emb = model.embed.weight
    plugins = _plugins(method="agg", head=head, window=4, lowrank_rank=3)
    plugins.setup(ModelHandle(model, input_embedding="embed"))
    plugins.begin_training(RunInfo())
    agg = plugins.get("agg")
    assert agg.head.module is model.lm_head  # AGG wraps the head that the head plugin left
    assert model.embed.weight is emb
    assert isinstance(model.lm_head, LowRankHead) == (head == "lowrank")
    if head == "untie":
        assert model.lm_head.weight is not emb
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(2))
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
    plugins.targets(targets, StepInfo(step=1))
    assert agg.head.armed
    logits = model(ids)
    assert not agg.head.armed  # the gated forward consumed the targets
    F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1)).backward()
    params = [model.lm_head.A, model.lm_head.B] if head == "lowrank" else [model.lm_head.weight]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    looked_up = torch.zeros(V, dtype=torch.bool)
    looked_up[ids.reshape(-1)] = True
    assert emb.grad[~looked_up].abs().max() == 0  # the embedding only gets its lookup gradient


def test_lowrank_head_on_bert_keeps_training_its_tied_bias(tmp_path):
    """BertForMaskedLM ties ``cls.predictions.bias`` to its decoder's bias. The low-rank head takes
    that very Parameter as its bias: after a real Trainer step it has a gradient and moved, and
    the model holds one bias, not a trained copy beside a stale original (which a later re-tie
    would put back). Before, the head carried a copy and ``cls.predictions.bias.grad`` was None."""
    from transformers import Trainer, TrainingArguments

    from aniso_plugins.integrations.hf import AnisoCallback
    from token_data import TokenDataset
    from zoo import bert

    model = bert()
    tied_bias = model.cls.predictions.bias
    before = tied_bias.detach().clone()
    grads = {}

    class Grad(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            grads["bias"] = model.cls.predictions.bias.grad

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, learning_rate=1e-2,
                             report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no")  # fmt: skip
    config = AnisoConfig(head="lowrank", lowrank_rank=4, metrics=(), load_entry_points=False)
    Trainer(model=model, args=args, train_dataset=TokenDataset(n=4), callbacks=[AnisoCallback(config), Grad()]).train()
    head = model.get_output_embeddings()
    assert isinstance(head, LowRankHead) and head.bias is model.cls.predictions.bias is tied_bias
    assert grads["bias"] is not None and grads["bias"].abs().sum() > 0
    assert not torch.equal(tied_bias.detach(), before)
    assert sum(p is tied_bias for p in model.parameters()) == 1
