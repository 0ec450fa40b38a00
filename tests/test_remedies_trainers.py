"""Coupled Adam, μ-centering and μ-loss through the real HF Trainer and `lightning.Trainer` (one
process, float64 models) against a training loop written here: PyTorch's own AdamW for every
other parameter and the papers' formulas for the output embedding (docs/methods.md §17-18); a
run resumed from the HF Trainer's checkpoint equals the uninterrupted run; the layouts these
methods cannot serve are refused at set-up."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from transformers import Trainer, TrainingArguments

from aniso_plugins import AnisoConfig, SetupError
from aniso_plugins.integrations.hf import AnisoCallback
from aniso_plugins.integrations.lightning import AnisoCallback as LightningCallback
from hf_utils import TokenDataset, tiny_llama
from lightning_utils import DIM, LitLM, loader

STEPS, LR, BETAS, EPS, MU_WEIGHT = 3, 1e-2, (0.9, 0.999), 1e-8, 5.0
METHODS = {
    "coupled_adam": dict(method="coupled_adam"),
    "mu_centering": dict(method="mu_centering"),
    "mu_loss": dict(method="mu_loss", mu_loss_weight=MU_WEIGHT),
    "coupled_adam+mu_centering": dict(method=("coupled_adam", "mu_centering")),
}


def reference_training(model: torch.nn.Module, head: torch.Tensor, loss_of, methods: tuple[str, ...], steps: int = STEPS):
    """`steps` steps of the papers' update on `model`, in place: torch.optim.AdamW for every
    parameter but the head's weight under Coupled Adam, which follows the formula
    m ← β1m + (1−β1)g, v ← β2v + (1−β2)g², E ← E − lr·(m/(1−β1^t)) / (√(mean_i v[i]/(1−β2^t)) + ε);
    μ-loss adds λ‖mean_i e_i‖² to the loss; μ-centering subtracts the mean row after the step."""
    coupled = "coupled_adam" in methods
    others = [p for p in model.parameters() if not (coupled and p is head)]
    opt = torch.optim.AdamW(others, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    m, v = torch.zeros_like(head), torch.zeros_like(head)
    for t in range(1, steps + 1):
        loss = loss_of(model)
        if "mu_loss" in methods:
            loss = loss + MU_WEIGHT * head.mean(0).square().sum()
        opt.zero_grad()
        head.grad = None
        loss.backward()
        opt.step()
        with torch.no_grad():
            if coupled:
                g = head.grad
                m = BETAS[0] * m + (1 - BETAS[0]) * g
                v = BETAS[1] * v + (1 - BETAS[1]) * g * g
                vbar = v.mean(0)  # one second moment per hidden dimension, over the vocabulary
                head -= LR * (m / (1 - BETAS[0] ** t)) / ((vbar / (1 - BETAS[1] ** t)).sqrt() + EPS)
            if "mu_centering" in methods:
                head -= head.mean(0)


# --- HF Trainer ------------------------------------------------------------------------------
def _hf_trainer(model, config, out, optimizers=(None, None), **kw) -> Trainer:
    args = TrainingArguments(**{
        **dict(output_dir=str(out), per_device_train_batch_size=8, max_steps=STEPS, learning_rate=LR,
               lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, adam_beta1=BETAS[0], adam_beta2=BETAS[1],
               adam_epsilon=EPS, optim="adamw_torch", use_cpu=True, report_to="none", disable_tqdm=True, logging_steps=1,
               save_strategy="no", seed=0),
        **kw,
    })
    return Trainer(model=model, args=args, train_dataset=TokenDataset(n=8), callbacks=[AnisoCallback(config)],
                   optimizers=optimizers)


def _batch() -> dict[str, torch.Tensor]:
    data = TokenDataset(n=8)
    return torch.utils.data.default_collate([data[i] for i in range(8)])


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("name", sorted(METHODS))
def test_hf_trainer_trains_the_formula(tmp_path, name, tied):
    model = tiny_llama(tied=tied).double()
    expected = copy.deepcopy(model)
    _hf_trainer(model, AnisoConfig(metrics=(), load_entry_points=False, **METHODS[name]), tmp_path).train()
    batch = _batch()
    reference_training(expected, expected.get_output_embeddings().weight, lambda mod: mod(**batch).loss,
                       AnisoConfig(**METHODS[name]).method)
    for (n, got), want in zip(model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=n)
    if "mu_centering" in name:
        assert model.get_output_embeddings().weight.mean(0).abs().max() < 1e-14


def test_hf_trainer_given_its_optimizer(tmp_path):
    """``Trainer(optimizers=(AdamW(...), None))``: the optimizer the user built is the one hooked."""
    model = tiny_llama(tied=False).double()
    expected = copy.deepcopy(model)
    given = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    config = AnisoConfig(method="coupled_adam", metrics=(), load_entry_points=False)
    _hf_trainer(model, config, tmp_path, optimizers=(given, None)).train()
    batch = _batch()
    reference_training(expected, expected.get_output_embeddings().weight, lambda mod: mod(**batch).loss, ("coupled_adam",))
    for (n, got), want in zip(model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=n)
    assert set(given.state[model.lm_head.weight]) == {"step", "exp_avg", "exp_avg_sq"}


def test_hf_resume_from_a_checkpoint_is_exact(tmp_path):
    """Coupled Adam's state (E's ``exp_avg`` / ``exp_avg_sq`` / ``step``) rides in the Trainer's
    optimizer.pt: resumed at step 2 of 4, the run ends where the uninterrupted one does."""
    config = AnisoConfig(method=("coupled_adam", "mu_centering"), metrics=(), load_entry_points=False)
    full = tiny_llama(tied=False).double()
    resumed = copy.deepcopy(full)
    _hf_trainer(full, config, tmp_path / "full", max_steps=4).train()
    _hf_trainer(copy.deepcopy(resumed), config, tmp_path / "cut", max_steps=4, save_strategy="steps", save_steps=2).train()
    again = _hf_trainer(resumed, config, tmp_path / "cut", max_steps=4)
    again.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-2"))
    for (n, a), b in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n


def test_hf_refuses_an_optimizer_coupled_adam_does_not_define(tmp_path):
    trainer = _hf_trainer(tiny_llama().double(), AnisoConfig(method="coupled_adam", metrics=(), load_entry_points=False),
                          tmp_path, optim="sgd")
    with pytest.raises(Exception, match="torch.optim.sgd.SGD: use torch.optim.AdamW"):
        trainer.train()


# --- Lightning -------------------------------------------------------------------------------
class LitAdam(LitLM):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)


PATHS = dict(head="model.lm_head", input_embedding="model.embed", blocks="model.blocks", targets="causal")


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("name", sorted(METHODS))
def test_lightning_trains_the_formula(name, tied):
    module = LitAdam(tied=tied).double()
    expected = copy.deepcopy(module)
    callback = LightningCallback(AnisoConfig(metrics=(), load_entry_points=False, **METHODS[name]), **PATHS)
    pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, precision="64-true", logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, callbacks=[callback]).fit(module, loader(n=8, batch_size=8))
    batch = next(iter(loader(n=8, batch_size=8)))
    reference_training(expected, expected.model.lm_head.weight, lambda mod: mod._loss(batch), AnisoConfig(**METHODS[name]).method)
    for (n, got), want in zip(module.named_parameters(), expected.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=n)


def test_lightning_resume_from_a_checkpoint_is_exact(tmp_path):
    """Coupled Adam's state rides in the ``.ckpt``'s optimizer state: a fit resumed at step 2 of 4
    ends where the uninterrupted fit does."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(module, steps, ckpt_path=None, save=False):
        callbacks = [LightningCallback(AnisoConfig(method=("coupled_adam", "mu_centering"), metrics=(),
                                                   load_entry_points=False), **PATHS)]
        if save:
            callbacks.append(ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}"))
        pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, precision="64-true", logger=False,
                   enable_checkpointing=save, enable_progress_bar=False, enable_model_summary=False,
                   callbacks=callbacks).fit(module, loader(n=16, batch_size=8), ckpt_path=ckpt_path)
        return module

    full = fit(LitAdam(tied=False).double(), 4)
    fit(LitAdam(tied=False).double(), 2, save=True)
    resumed = fit(LitAdam(tied=False).double(), 4, ckpt_path=str(tmp_path / "step=2.ckpt"))
    for (n, a), b in zip(full.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("method", ["coupled_adam", "mu_centering"])
@pytest.mark.parametrize("strategy", ["fsdp1", "deepspeed"])
def test_lightning_refuses_flat_optimizers_at_setup(method, strategy, monkeypatch):
    """FSDPStrategy (FSDP1) and DeepSpeedStrategy step flat buffers: refused at the callback's
    set-up, naming the strategy and the way out, before the model is changed."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    import aniso_plugins.integrations.lightning as adapter

    cls = FSDPStrategy if strategy == "fsdp1" else DeepSpeedStrategy
    module = LitAdam()
    trainer = type("T", (), {"strategy": cls.__new__(cls)})()
    callback = LightningCallback(AnisoConfig(method=method, metrics=(), load_entry_points=False), **PATHS)
    with pytest.raises(SetupError, match="ModelParallelStrategy"):
        callback.setup(trainer, module, "fit")
    assert callback.session.handle is None and adapter is not None


@pytest.mark.slow
@pytest.mark.parametrize("methods", [("coupled_adam", "mu_centering"), ("mu_loss",)])
def test_lightning_fsdp2_equals_one_process(tmp_path, methods):
    """`ModelParallelStrategy` (FSDP2: the tied head and embedding as row shards, DTensors) on
    two processes against one process on the same global batches: weights and logged values."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([here, os.path.join(here, "..", "examples")]))
    runs = {}
    for mode in ("single", "fsdp2"):
        out = tmp_path / f"{mode}.json"
        proc = subprocess.run([sys.executable, os.path.join(here, "lightning_remedies_script.py"), mode, str(out), *methods],
                              env=env, timeout=300, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[mode] = json.loads(out.read_text())
    single, fsdp2 = runs["single"], runs["fsdp2"]
    assert fsdp2["types"]["model.embed.weight"] == "DTensor" and single["types"]["model.embed.weight"] == "Parameter"
    assert single["metrics"] and fsdp2["metrics"].keys() == single["metrics"].keys()
    for name, value in single["metrics"].items():
        assert fsdp2["metrics"][name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    for name, value in single["weights"].items():
        got, want = torch.tensor(fsdp2["weights"][name]), torch.tensor(value)
        if name.endswith("in_proj_bias"):  # the key bias: softmax makes its gradient 0 up to rounding, which
            got[DIM : 2 * DIM] = want[DIM : 2 * DIM]  # AdamW's normalised step turns into ±lr (also without aniso)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=name)
    moved = torch.tensor(single["weights"]["model.embed.weight"]) - LitAdam().model.embed.weight.double()
    assert moved.abs().max() > 1e-3
