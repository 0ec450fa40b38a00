"""The fused loss where the users are: the HF Trainer's and Lightning's training loss computed in
the LM head chunk by chunk (docs/methods.md §16). References: a run of the same model and data
without the callback (the model's own loss through the real Trainer), and F.cross_entropy of
float64 logits. The model-zoo test covers every architecture family; this file the routes,
the defaults and the refusals."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments

from aniso_plugins import AnisoConfig, ConfigError, fused_linear_cross_entropy
from aniso_plugins.integrations.hf import AnisoCallback
from aniso_plugins.integrations.lightning import AnisoCallback as LightningCallback
from hf_utils import TokenDataset, tiny_gpt2, tiny_llama
from lightning_utils import GradCapture, LitLM, loader
from token_data import VOCAB

QUIET = dict(report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no", seed=0, data_seed=0, max_grad_norm=0.0)
QUICK = dict(metrics=(), load_entry_points=False)


def _train(tmp_path, model, config=None, steps=2, trainer_cls=Trainer, **args):
    """Train `steps` optimizer steps; returns (the losses training_step returned, the final
    head weight, the trainer)."""
    callbacks = [AnisoCallback(config)] if config is not None else []
    trainer = trainer_cls(
        model=model,
        args=TrainingArguments(output_dir=str(tmp_path), max_steps=steps, learning_rate=1e-2,
                               **{**QUIET, "per_device_train_batch_size": 4, **args}),
        train_dataset=TokenDataset(n=16, length=8, vocab=VOCAB, seed=1),
        eval_dataset=TokenDataset(n=4, length=8, vocab=VOCAB, seed=2),
        callbacks=callbacks,
    )
    losses = []
    step = trainer.training_step
    trainer.training_step = lambda *a, **k: losses.append(step(*a, **k)) or losses[-1]
    trainer.train()
    return [float(x) for x in losses], model.get_output_embeddings().weight.detach().clone(), trainer


def test_float64_fused_label_smoothing_equals_f_cross_entropy():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, 11, (3, 7), generator=g)
    y[0, :3] = -100
    got = fused_linear_cross_entropy(h, w, y, label_smoothing=0.2, chunk_size=4)
    ref = F.cross_entropy((h @ w.T).reshape(-1, 11), y.reshape(-1), label_smoothing=0.2)
    assert abs(float((got - ref).detach())) < 1e-12
    for a, b in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(ref, (h, w))):
        assert float((a - b).abs().max()) < 1e-12


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32])
def test_integer_targets_of_any_dtype_as_f_cross_entropy(dtype):
    """uint8 / int16 / int32 targets give F.cross_entropy's loss and gradients (float64), fused and
    through gated_linear with all-one gates. Before, uint8 failed in gather() ("Expected dtype
    int32/int64 for index"), and gated_linear indexed with it as a boolean mask."""
    from aniso_plugins import RowGates, gated_linear

    g = torch.Generator().manual_seed(0)
    h = torch.randn(12, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(20, 8, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 20, (12,), generator=g)
    loss = F.cross_entropy(F.linear(h, w), t)
    expected = torch.autograd.grad(loss, (h, w))
    fused = fused_linear_cross_entropy(h, w, t.to(dtype))
    torch.testing.assert_close(fused, loss, rtol=1e-12, atol=0)
    for got, want in zip(torch.autograd.grad(fused, (h, w)), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    ones = torch.ones(20, dtype=torch.float64)
    logits = gated_linear(h, w, t.to(dtype), RowGates(ones, ones, torch.zeros(20, dtype=torch.bool)))
    gated = F.cross_entropy(logits, t)
    for got, want in zip(torch.autograd.grad(gated, (h, w)), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)


def test_float64_under_bf16_autocast_stays_float64():
    """Autocast leaves float64 alone, as F.linear + F.cross_entropy do: the fused loss equals the
    float64 reference to 1e-12 (before, it ran in bf16: 9e-4 relative)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, 32, generator=g, dtype=torch.float64)
    w = torch.randn(500, 32, generator=g, dtype=torch.float64)
    t = torch.randint(0, 500, (64,), generator=g)
    expected = F.cross_entropy(F.linear(h, w), t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused_linear_cross_entropy(h, w, t)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "agg"])
def test_float32_fused_loss_where_the_target_probability_underflows(gated, smoothing):
    """Rows whose target logit is hundreds of nats below the row's maximum: p_{i,y_i} underflows
    float32 (its −log would be inf), so these rows take logsumexp − z_y from recomputed logits.
    The reference is F.cross_entropy of the same logits in float64."""
    from aniso_plugins import agg_gates

    g = torch.Generator().manual_seed(3)
    v, d = 40, 8
    h = torch.randn(2, 24, d, generator=g)
    w = torch.randn(v, d, generator=g)
    y = torch.randint(0, v, (2, 24), generator=g)
    y[1, :4] = -100
    for i, j in [(0, 0), (0, 5), (1, 9), (1, 23)]:  # the target far below the rest: a loss of ≈ 300 nats
        w_y = w[y[i, j]]
        h[i, j] = -60.0 * w_y / w_y.norm() ** 2
    gates = agg_gates(torch.rand(v, generator=g), 0.3) if gated else None
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    ref = F.cross_entropy((h64 @ w64.T).reshape(-1, v), y.reshape(-1), label_smoothing=smoothing)
    assert float(ref.detach()) * 2 * 24 > 4 * 200  # the four rows really are hundreds of nats
    h32, w32 = h.clone().requires_grad_(), w.clone().requires_grad_()
    got = fused_linear_cross_entropy(h32, w32, y, gates, label_smoothing=smoothing, chunk_size=7)
    assert torch.isfinite(got) and abs(float(got) - float(ref)) < 1e-5 * float(ref)
    dh, dw = torch.autograd.grad(got, (h32, w32))
    rh, rw = torch.autograd.grad(ref, (h64, w64))
    assert float((dh.double() - rh).abs().max()) < 1e-5 * float(rh.abs().max())
    if not gated:  # the gated weight gradient is compared with the three-logit reference in test_agg.py
        assert float((dw.double() - rw).abs().max()) < 1e-5 * float(rw.abs().max())


@pytest.mark.parametrize("build", [tiny_gpt2, lambda: tiny_llama(tied=False)], ids=["gpt2", "llama_untied"])
@pytest.mark.parametrize("case", ["plain", "accumulation", "label_smoothing"])
def test_hf_fused_loss_trains_exactly_as_the_models_own_loss(tmp_path, build, case):
    args = {"accumulation": dict(gradient_accumulation_steps=2, per_device_train_batch_size=2),
            "label_smoothing": dict(label_smoothing_factor=0.1)}.get(case, {})
    base, w_base, _ = _train(tmp_path / "base", build(), **args)
    got, w_got, trainer = _train(tmp_path / "fused", build(), AnisoConfig(fused_loss=True, **QUICK), **args)
    assert trainer.callback_handler.callbacks[1].session.head_computes_loss
    assert len(got) == len(base) == 2 * (2 if case == "accumulation" else 1)
    for a, b in zip(got, base):  # every micro-batch's loss, as the Trainer normalized it
        assert abs(a - b) <= 2e-6 * abs(b), (got, base)
    assert float((w_got - w_base).abs().max()) <= 1e-5 * float(w_base.abs().max())
    if case == "label_smoothing":  # the smoothing reached the fused loss: the plain loss differs
        plain, _, _ = _train(tmp_path / "plain", build(), AnisoConfig(fused_loss=True, **QUICK))
        assert abs(plain[0] - got[0]) > 20 * 2e-6 * abs(got[0])  # near-uniform logits: a small but clear change


def test_hf_evaluation_still_returns_logits_and_the_models_loss(tmp_path):
    model = tiny_gpt2()
    _, _, trainer = _train(tmp_path, model, AnisoConfig(method="agg", window=4, **QUICK))
    assert trainer.callback_handler.callbacks[1].session.head_computes_loss  # AGG: fused by default
    out = trainer.predict(trainer.eval_dataset)
    assert out.predictions.shape == (4, 8, VOCAB)
    logits = torch.as_tensor(out.predictions, dtype=torch.float64)
    labels = torch.as_tensor(out.label_ids)
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    assert abs(out.metrics["test_loss"] - float(ref)) < 1e-5


def test_hf_an_unreproducible_loss_stays_on_the_gated_head_with_one_info_line(tmp_path, caplog):
    def own_loss(outputs, labels, num_items_in_batch=None):
        logits = outputs["logits"]
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    with caplog.at_level(logging.INFO, logger="aniso_plugins"):
        base, w_base, trainer = _train(tmp_path, tiny_gpt2(), AnisoConfig(method="agg", window=4, **QUICK),
                                       trainer_cls=lambda **kw: Trainer(compute_loss_func=own_loss, **kw))
    assert not trainer.callback_handler.callbacks[1].session.head_computes_loss
    lines = [r.getMessage() for r in caplog.records if "not the fused loss" in r.getMessage()]
    assert lines == ["aniso_plugins: AGG runs as the gated LM head, not the fused loss: the Trainer has a "
                     "compute_loss_func, which computes the loss from the logits"]
    with pytest.raises(ConfigError, match="fused_loss=True: the Trainer has a compute_loss_func"):
        _train(tmp_path, tiny_gpt2(), AnisoConfig(fused_loss=True, **QUICK),
               trainer_cls=lambda **kw: Trainer(compute_loss_func=own_loss, **kw))


def test_hf_a_trainer_subclass_with_its_own_compute_loss_is_not_fused(tmp_path):
    class MyTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = model(**inputs)
            return (out.loss, out) if return_outputs else out.loss

    with pytest.raises(ConfigError, match="MyTrainer.compute_loss replaces the Trainer's loss"):
        _train(tmp_path, tiny_gpt2(), AnisoConfig(fused_loss=True, **QUICK), trainer_cls=MyTrainer)


def test_hf_a_metric_that_reads_the_training_logits_keeps_them(tmp_path):
    _, _, trainer = _train(tmp_path, tiny_gpt2(), AnisoConfig(method="agg", window=4, metrics=("bottleneck",),
                                                              load_entry_points=False), logging_steps=1)
    assert not trainer.callback_handler.callbacks[1].session.head_computes_loss
    assert any("aniso/bottleneck/" in k for r in trainer.state.log_history for k in r)


def test_hf_detach_restores_the_loss_function_and_the_label_smoother(tmp_path):
    model = tiny_gpt2()
    before = model.loss_function
    _, _, trainer = _train(tmp_path, model, AnisoConfig(fused_loss=True, **QUICK), label_smoothing_factor=0.1)
    smoother = trainer.label_smoother
    assert model.loss_function is not before and type(smoother).__name__ == "FusedLabelSmoother"
    trainer.callback_handler.callbacks[1].detach()
    assert model.loss_function is before and "_loss_function" not in model.__dict__
    assert trainer.label_smoother is smoother.original


# --- Lightning ----------------------------------------------------------------------------------
class LitOwnLoss(LitLM):
    """A LightningModule that computes its loss through the callback's loss_fn."""

    aniso_loss_fn = None

    def _loss(self, batch):
        m = self.model
        h = m.embed(batch["input_ids"])
        mask = torch.nn.Transformer.generate_square_subsequent_mask(h.shape[1])
        for block in m.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.aniso_loss_fn(h)


class Fused(pl.Callback):
    """Records whether the session fused the loss (teardown after fit detaches the session)."""

    def __init__(self, cb):
        self.cb, self.seen = cb, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(self.cb.session.head_computes_loss)


def _lightning_trainer(tmp_path, callbacks, max_steps=2, **kw) -> pl.Trainer:
    """A quiet CPU lightning.Trainer validating one batch at step 2 (``kw`` overrides)."""
    kw = {"limit_val_batches": 1, "val_check_interval": 2, **kw}
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                      num_sanity_val_steps=0, callbacks=callbacks, **kw)


def _fit(tmp_path, module, config):
    cap = GradCapture()
    cb = LightningCallback(config, head="model.lm_head", input_embedding="model.embed", blocks="model.blocks", targets="causal")
    fused = Fused(cb)
    trainer = _lightning_trainer(tmp_path, [cb, cap, fused])
    trainer.fit(module, loader(), loader(n=4))
    assert len(set(fused.seen)) == 1
    return cap.grads, fused.seen[0], trainer


@pytest.mark.parametrize("method", ["none", "agg"])
def test_lightning_loss_fn_is_fused_and_equals_the_modules_own_loss(tmp_path, method):
    agg = dict(method="agg", window=4) if method == "agg" else {}
    ref, _, _ = _fit(tmp_path, LitLM(tied=False), AnisoConfig(fused_loss=False, **agg, **QUICK))  # logits route
    got, fused, trainer = _fit(tmp_path, LitOwnLoss(tied=False), AnisoConfig(fused_loss=True, **agg, **QUICK))
    assert fused
    for step_ref, step_got in zip(ref, got):
        for name in ("model.lm_head.weight", "model.embed.weight"):
            scale = float(step_ref[name].abs().max())
            assert float((step_got[name] - step_ref[name]).abs().max()) <= 1e-5 * scale, name
    assert "val_loss" in trainer.callback_metrics  # validation: loss_fn from the logits


def test_lightning_agg_without_loss_fn_is_gated_and_says_why(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="aniso_plugins"):
        _, fused, _ = _fit(tmp_path, LitLM(), AnisoConfig(method="agg", window=4, **QUICK))
    assert not fused
    assert any("declare aniso_loss_fn = None" in r.getMessage() for r in caplog.records)


class LitHF(pl.LightningModule):
    """An HF causal LM inside a LightningModule, trained on its own ``outputs.loss``; records the
    shape of the training forwards' logits (0-dim: the loss was fused in the head)."""

    def __init__(self):
        super().__init__()
        self.model = tiny_llama(tied=False)
        self.logit_dims: list[int] = []

    def training_step(self, batch, batch_idx):
        out = self.model(input_ids=batch["input_ids"], labels=batch["labels"])
        self.logit_dims.append(out.logits.dim())
        return out.loss

    def validation_step(self, batch, batch_idx):
        out = self.model(input_ids=batch["input_ids"], labels=batch["labels"])
        assert out.logits.dim() == 3  # evaluation: the model's logits and its own loss
        self.log("val_loss", out.loss, batch_size=len(batch["input_ids"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_hf_model_inside_with_fused_loss_trains_as_its_own_loss(tmp_path, accumulate):
    """The second Lightning route: an HF model inside the module, `fused_loss=True`. Reference:
    the same module fitted by a plain lightning.Trainer without the callback (the model's own
    loss from its logits)."""
    def fit(callbacks):
        cap = GradCapture()
        module = LitHF()
        trainer = _lightning_trainer(tmp_path, [*callbacks, cap], accumulate_grad_batches=accumulate)
        trainer.fit(module, loader(), loader(n=4))
        return cap.grads, module

    ref, plain = fit([])
    cb = LightningCallback(AnisoConfig(fused_loss=True, **QUICK))
    fused = Fused(cb)
    got, module = fit([cb, fused])
    assert fused.seen == [True] * (2 * accumulate) and module.logit_dims == [0] * (2 * accumulate)
    assert plain.logit_dims == [3] * (2 * accumulate)
    assert len(got) == len(ref) == 2
    for step_ref, step_got in zip(ref, got):
        assert step_ref.keys() == step_got.keys()
        for name, r in step_ref.items():
            assert float((step_got[name] - r).abs().max()) <= 1e-5 * float(r.abs().max()), name


def test_lightning_hf_model_inside_is_not_fused_by_default_and_says_why(tmp_path, caplog):
    cb = LightningCallback(AnisoConfig(method="agg", window=4, **QUICK))
    fused = Fused(cb)
    trainer = _lightning_trainer(tmp_path, [cb, fused], max_steps=1, limit_val_batches=0)
    module = LitHF()
    with caplog.at_level(logging.INFO, logger="aniso_plugins"):
        trainer.fit(module, loader())
    assert fused.seen == [False] and module.logit_dims == [3]
    assert any("set fused_loss=True if it uses only outputs.loss" in r.getMessage() for r in caplog.records)
