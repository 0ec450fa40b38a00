"""Models whose forward transforms the head's logits before their loss (Gemma 2 and 3's soft-cap,
Cohere's logit scale, Granite's logit divisor, Falcon-H1's head multiplier; Gemma 3 without a
soft-cap) train AGG on the
fused loss through the real `transformers.Trainer`: the same logged loss and gradients as AGG on
the gated head, where the model applies its own transform to the gated logits (the path tested
against the float64 three-logit reference elsewhere), one step, every parameter. Before, these
models fell back to the gated head ("forward assigns logits again after the head")."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from hf_utils import GradCapture, TokenDataset
from token_data import VOCAB
from transformers import Trainer, TrainingArguments

from aniso_plugins import AnisoConfig
from aniso_plugins.integrations.hf import AnisoCallback

SMALL = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=32, pad_token_id=0, bos_token_id=0, eos_token_id=1)  # fmt: skip


def gemma2(cap=2.0):
    return T.Gemma2ForCausalLM(T.Gemma2Config(**SMALL, head_dim=8, final_logit_softcapping=cap, attn_logit_softcapping=None))


def gemma3(cap=2.0):
    return T.Gemma3ForCausalLM(T.Gemma3TextConfig(**SMALL, head_dim=8, final_logit_softcapping=cap, sliding_window=8))


def cohere():
    return T.CohereForCausalLM(T.CohereConfig(**SMALL, logit_scale=0.5))


def granite():
    return T.GraniteForCausalLM(T.GraniteConfig(**SMALL, logits_scaling=4.0))


def falcon_h1():
    return T.FalconH1ForCausalLM(T.FalconH1Config(
        **SMALL, head_dim=8, mamba_d_ssm=16, mamba_n_heads=2, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, lm_head_multiplier=0.5,
    ))  # fmt: skip


BUILDS = {"falcon_h1": falcon_h1, "gemma2": gemma2, "gemma3": gemma3, "gemma3_uncapped": lambda: gemma3(None), "cohere": cohere, "granite": granite}
EXPECTED = {"falcon_h1": (0.5, None), "gemma2": (1.0, 2.0), "gemma3": (1.0, 2.0), "gemma3_uncapped": None, "cohere": (0.5, None), "granite": (0.25, None)}


def _run(tmp_path, build, fused: bool, method: str | tuple[str, ...] = "agg"):
    torch.manual_seed(0)
    model = build()
    capture = GradCapture()
    callback = AnisoCallback(AnisoConfig(method=method, alpha=2.0, window=2, metrics=(), fused_loss=fused,
                                         load_entry_points=False))  # fmt: skip
    args = TrainingArguments(output_dir=str(tmp_path / str(fused)), max_steps=1, per_device_train_batch_size=4,
                             learning_rate=1e-2, report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no",
                             max_grad_norm=0.0, logging_steps=1, seed=0)  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(n=4), callbacks=[callback, capture])
    transform = callback.session.handle.logit_transform
    head_computes_loss = callback.session.head_computes_loss
    trainer.train()
    return trainer.state.log_history[0]["loss"], capture.grads[0], head_computes_loss, transform


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_a_transformed_head_trains_agg_on_the_fused_loss_as_on_the_gated_head(tmp_path, name):
    loss, grads, fused, transform = _run(tmp_path, BUILDS[name], True)
    gated_loss, gated_grads, gated_fused, _ = _run(tmp_path, BUILDS[name], False)
    assert fused and not gated_fused  # the fused loss really ran
    expected = EXPECTED[name]
    assert (transform is None) if expected is None else ((transform.scale, transform.softcap) == pytest.approx(expected))
    assert loss == pytest.approx(gated_loss, rel=1e-5)
    assert grads.keys() == gated_grads.keys()
    for key, grad in gated_grads.items():
        torch.testing.assert_close(grads[key], grad, rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", ["gemma2", "cohere"])
def test_a_loss_term_on_a_transformed_head_keeps_the_fused_sum_passing_through(tmp_path, name):
    """AGG with CosReg on a soft-capped or scaled head: the regularizer's term is attached to the
    head's fused sum, which must stay the `FusedLossSum` the forward's transform passes through
    (before, the attached tensor lost the wrapper and the loss function raised at step 1)."""
    loss, grads, fused, _ = _run(tmp_path, BUILDS[name], True, ("agg", "cosreg"))
    gated_loss, gated_grads, _, _ = _run(tmp_path, BUILDS[name], False, ("agg", "cosreg"))
    assert fused and loss == pytest.approx(gated_loss, rel=1e-5)
    for key, grad in gated_grads.items():
        torch.testing.assert_close(grads[key], grad, rtol=1e-4, atol=1e-6, msg=key)


def test_the_forward_s_operations_are_checked_against_the_transform_fused():
    """The fused sum passes the forward's own transform through and records it; a transform other
    than the one fused at set-up, or a value that lost its wrapper, is an error, never a silently
    wrong loss."""
    from aniso_plugins import LogitTransform
    from aniso_plugins.methods.fused_loss.loss_sum import IDENTITY, FusedLossSum, fused_sum, transform_of

    total = torch.tensor(7.5, requires_grad=True)
    value = FusedLossSum.wrap(total * 1.0)
    value = torch.tanh(value / 2.0) * 2.0  # Gemma's soft-cap statements, cap 2
    assert value.ops == [("div", 2.0), ("tanh",), ("mul", 2.0)]
    plain = fused_sum(value, LogitTransform(1.0, 2.0))
    assert type(plain) is torch.Tensor and float(plain) == 7.5
    plain.backward()
    assert float(total.grad) == 1.0  # the gradient flows to the fused loss unchanged
    with pytest.raises(RuntimeError, match="applied"):
        fused_sum(FusedLossSum.wrap(torch.tensor(1.0)) * 3.0, LogitTransform(1.0, 2.0))
    with pytest.raises(RuntimeError, match="fused_loss=False"):
        fused_sum(torch.tensor(1.0), LogitTransform(0.5))
    assert fused_sum(torch.tensor(1.0), IDENTITY) == 1.0
    assert transform_of([("mul", 0.5)]) == LogitTransform(0.5)
    assert transform_of([("div", 4.0)]) == LogitTransform(0.25)
    capped = transform_of([("mul", 2.0), ("div", 30.0), ("tanh",), ("mul", 30.0)])
    assert (capped.scale, capped.softcap) == pytest.approx((2.0, 30.0))
    assert "no loss can be fused" in transform_of([("mul", 0.0)])
    assert "more than once" in transform_of([("tanh",), ("tanh",)])
    assert "positive" in transform_of([("tanh",), ("mul", -1.0)])
