"""The Lightning adapter with a real lightning.Trainer on a tiny plain-PyTorch LM (CPU)."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from aniso_plugins import AnisoConfig, SetupError, StateError, hookimpl
from aniso_plugins.integrations.lightning import AnisoCallback
from lightning_utils import GradCapture, LitLM, loader
from references import agg_first_step_grad, regularizer_grad
from third_party_plugin import HeadNormPlugin
from token_data import VOCAB

HERE = os.path.dirname(os.path.abspath(__file__))
PATHS = dict(head="model.lm_head", input_embedding="model.embed", blocks="model.blocks", targets="causal")


def fit(tmp_path, config=None, plugins=(), callbacks=(), module=None, ckpt_path=None, **trainer_kw):
    cb = AnisoCallback(config or AnisoConfig(metrics=(), load_entry_points=False), plugins, **PATHS)
    kw = dict(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        num_sanity_val_steps=0,
    )
    kw.update(trainer_kw)
    trainer = pl.Trainer(callbacks=[cb, *callbacks], **kw)
    module = module or LitLM()
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    return trainer, module, cb


def test_loss_term_once_per_optimizer_step_under_accumulation(tmp_path):
    grads, w0 = {}, LitLM().model.embed.weight.detach().clone()
    for coef in (0.0, 0.25):
        cap = GradCapture()
        fit(tmp_path, plugins=[HeadNormPlugin(coef)], callbacks=[cap], accumulate_grad_batches=3)
        grads[coef] = cap.grads[0]["model.embed.weight"]
    torch.testing.assert_close(grads[0.25] - grads[0.0], 2 * 0.25 * w0, rtol=1e-4, atol=1e-6)


def test_loss_terms_follow_the_fp16_grad_scaler(tmp_path):
    class ScalerOn(pl.Callback):  # what 16-mixed holds (on CUDA); the loss stays unscaled here
        def setup(self, trainer, pl_module, stage):
            trainer.precision_plugin.scaler = torch.amp.GradScaler("cpu", init_scale=8.0)

    grads, w0 = {}, LitLM().model.embed.weight.detach().clone()
    for coef in (0.0, 0.25):
        cap = GradCapture()
        fit(tmp_path, plugins=[HeadNormPlugin(coef)], callbacks=[ScalerOn(), cap])
        grads[coef] = cap.grads[0]["model.embed.weight"]
    torch.testing.assert_close(grads[0.25] - grads[0.0], 8.0 * 2 * 0.25 * w0, rtol=1e-4, atol=1e-6)


def test_agg_first_step_gradient_equals_three_logit_reference(tmp_path):
    alpha = 1.5
    cap_mle = GradCapture()
    fit(tmp_path, callbacks=[cap_mle])
    module = LitLM()
    w0 = module.model.lm_head.weight.detach().clone()
    hidden = []
    module.model.lm_head.register_forward_pre_hook(lambda m, a: hidden.append(a[0].detach().clone()))
    cap = GradCapture()
    cfg = AnisoConfig(method="agg", alpha=alpha, window=4, metrics=(), load_entry_points=False)
    fit(tmp_path, cfg, callbacks=[cap], module=module)

    # LitLM's loss is the mean over the T-1 shifted positions, the reference's targets
    mle = cap_mle.grads[0]["model.embed.weight"]
    expected = agg_first_step_grad(mle, hidden[0], w0, next(iter(loader()))["labels"], alpha, VOCAB)
    got = cap.grads[0]["model.embed.weight"].double()
    assert not torch.allclose(expected, mle.double(), rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("method", ["cosreg", "hinge", "spectrum"])
def test_regularizer_gradient_equals_reference_once_per_step(tmp_path, method):
    grads, w0 = {}, LitLM().model.embed.weight.detach().clone()
    for m in ("none", method):
        cap = GradCapture()
        cfg = AnisoConfig(method=m, reg_weight=0.3, hinge_margin=0.1, metrics=(), load_entry_points=False)
        fit(tmp_path, cfg, callbacks=[cap], accumulate_grad_batches=2)
        grads[m] = cap.grads[0]["model.embed.weight"].double()
    expected = 0.3 * regularizer_grad(method, w0, margin=0.1)
    assert expected.abs().max() > 1e-6
    torch.testing.assert_close(grads[method] - grads["none"], expected, rtol=1e-4, atol=1e-7)


def test_metrics_in_csv_logger_with_lightning_steps(tmp_path):
    logger = CSVLogger(str(tmp_path), name="run")
    trainer, module, _ = fit(
        tmp_path, plugins=[HeadNormPlugin(1e-3)], max_steps=6, logger=logger, log_every_n_steps=2,
        accumulate_grad_batches=2,
    )
    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("aniso/head_norm/rms_row_norm")]
    # optimizer steps 2, 4, 6 are logged (Lightning's logger step is 0-based: 1, 3, 5)
    assert [int(r["step"]) for r in rows] == [1, 3, 5]
    w = module.model.lm_head.weight.detach().double()
    assert float(rows[-1]["aniso/head_norm/rms_row_norm"]) == pytest.approx(float(w.pow(2).sum(1).mean().sqrt()), rel=1e-6)
    assert all(r["aniso/loss/head_l2"] for r in rows)


def test_resume_equals_uninterrupted_run(tmp_path):
    cfg = dict(method="agg", alpha=0.5, window=3, metrics=(), load_entry_points=False)
    # interrupted at an epoch boundary (8 batches): a plain DataLoader cannot resume mid-epoch
    _, straight, cb_a = fit(tmp_path / "a", AnisoConfig(**cfg), max_steps=12)
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"), every_n_train_steps=8, save_top_k=-1)
    fit(tmp_path / "b", AnisoConfig(**cfg), max_steps=8, callbacks=[ckpt], enable_checkpointing=True)
    path = os.path.join(tmp_path / "ck", os.listdir(tmp_path / "ck")[0])
    _, resumed, cb_b = fit(tmp_path / "c", AnisoConfig(**cfg), max_steps=12, ckpt_path=path)
    for (name, p), (_, q) in zip(straight.named_parameters(), resumed.named_parameters()):
        assert torch.equal(p, q), name
    a, b = cb_a.session.plugins.state_dict(), cb_b.session.plugins.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n][k], b[n][k]) for n in a for k in a[n])
    with pytest.raises(StateError, match="window=4 needs 3.*on_state_mismatch='reset'"):  # not exactly re-cuttable
        fit(tmp_path / "d", AnisoConfig(**{**cfg, "window": 4}), max_steps=12, ckpt_path=path)


def test_errors_before_the_first_step(tmp_path):
    with pytest.raises(SetupError, match="found no LM head"):
        pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                   callbacks=[AnisoCallback(AnisoConfig(metrics=(), load_entry_points=False))]).fit(LitLM(), loader())
    module = LitLM()
    w = module.model.lm_head.weight.detach().clone()

    class Unlabelled(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {"input_ids": torch.zeros(8, dtype=torch.long)}

    cb = AnisoCallback(AnisoConfig(metrics=(), load_entry_points=False), **PATHS)
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, callbacks=[cb])
    with pytest.raises(SetupError, match="'labels'"):
        trainer.fit(module, torch.utils.data.DataLoader(Unlabelled(), batch_size=4))
    assert torch.equal(module.model.lm_head.weight, w)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes(tmp_path, strategy):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([HERE, os.path.join(HERE, "..", "examples")]))
    script = os.path.join(HERE, "lightning_dist_script.py")
    for mode in ("single", strategy):
        out = subprocess.run([sys.executable, script, mode, str(tmp_path)], env=env, timeout=300, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-3000:]
    r = [json.load(open(tmp_path / f"{strategy}{i}.json")) for i in range(2)]
    single = json.load(open(tmp_path / "single0.json"))
    assert r[0]["state"] == r[1]["state"] == single["state"]  # identical counters (gates) on every rank
    assert r[0]["metrics"] == r[1]["metrics"]
    # equal to one process on the same global batches: the loss term (coef 0.5, SGD) shrinks the
    # weights; counted twice across ranks, the weights and these metrics would differ
    assert single["metrics"] and r[0]["metrics"].keys() == single["metrics"].keys()
    for name, value in single["metrics"].items():
        assert r[0]["metrics"][name] == pytest.approx(value, rel=1e-5), name


@pytest.mark.slow
def test_tensor_parallel_head_is_refused_before_the_first_step(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([HERE, os.path.join(HERE, "..", "examples")]))
    script = os.path.join(HERE, "lightning_dist_script.py")
    out = subprocess.run([sys.executable, script, "tp", str(tmp_path)], env=env, timeout=300, capture_output=True, text=True)
    assert out.returncode != 0
    assert "SetupError: the LM head's weight is tensor-parallel" in out.stderr and "parallelize_module" in out.stderr
    assert not (tmp_path / "tp0.json").exists()  # the fit stopped


class Observer:
    """Records what the plugins are told: training targets and logged metrics."""

    name = "observer"

    def __init__(self):
        self.targets, self.steps, self.logged = [], [], []

    @hookimpl
    def aniso_targets(self, targets, step):
        self.targets.append(targets.clone())
        self.steps.append(step)

    @hookimpl
    def aniso_log(self, metrics, step, kind):
        self.logged.append((kind, step, dict(metrics)))


def test_default_targets_prefer_shift_labels_like_transformers(tmp_path):
    def with_shift_labels(items):
        batch = torch.utils.data.default_collate(items)
        batch["shift_labels"] = torch.full_like(batch["labels"], -100)
        batch["shift_labels"][:, 0] = 7  # not the causal shift of labels
        return batch

    observer = Observer()
    cb = AnisoCallback(AnisoConfig(metrics=(), load_entry_points=False), [observer], **PATHS)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[cb],
    )
    data = loader()
    trainer.fit(LitLM(), torch.utils.data.DataLoader(data.dataset, batch_size=4, collate_fn=with_shift_labels))
    expected = torch.full((4, 8), -100)
    expected[:, 0] = 7
    assert len(observer.targets) == 1 and torch.equal(observer.targets[0], expected)


def test_validation_reports_group_perplexity_and_uniq(tmp_path):
    cfg = AnisoConfig(metrics=("eval",), load_entry_points=False)
    observer = Observer()
    cb = AnisoCallback(cfg, [observer], **PATHS)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[cb], num_sanity_val_steps=2, val_check_interval=3,
    )
    module = LitLM()
    valid = loader(n=8, seed=1)
    trainer.fit(module, loader(), valid)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    # independent: the module's own validation loss (equal-size batches, mean of batch means)
    assert metrics["val_aniso/eval/ppl"] == pytest.approx(math.exp(metrics["val_loss"]), rel=1e-5)
    ids = valid.dataset.ids
    with torch.no_grad():
        predicted = module.model(ids)[:, :-1].argmax(-1)
    assert metrics["val_aniso/eval/uniq"] == len(set(predicted.flatten().tolist()))
    # the plugins' aniso_log sees the validation metrics too, under the names Lightning logged
    (kind, step, logged), = [entry for entry in observer.logged if entry[0] == "eval"]
    assert step == 3 and logged["val_aniso/eval/ppl"] == pytest.approx(metrics["val_aniso/eval/ppl"], rel=1e-6)


def test_report_at_end_writes_the_trained_geometry(tmp_path):
    import json

    trainer, module, _ = fit(tmp_path, AnisoConfig(report_at_end=True, metrics=(), load_entry_points=False), max_steps=2)
    folder = tmp_path / "aniso_report"
    report = json.loads((folder / "report.json").read_text())
    assert (folder / "report.md").exists() and list(folder.glob("*.png"))
    # the tied matrix's mean cosine, against an explicit pairwise formula in float64
    w = module.model.embed.weight.detach().double()
    u = w / w.norm(dim=1, keepdim=True)
    c = u @ u.T
    expected = float((c.sum() - c.diagonal().sum()) / (len(w) * (len(w) - 1)))
    assert min(abs(v - expected) for v in _numbers(report)) < 1e-9


def _numbers(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _numbers(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _numbers(v)
    elif isinstance(tree, float):
        yield tree


def test_a_head_named_by_path_needs_its_target_alignment(tmp_path):
    """A plain-PyTorch model says nothing of how its loss aligns the labels: the callback asks
    instead of guessing a causal shift."""
    paths = {k: v for k, v in PATHS.items() if k != "targets"}
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[AnisoCallback(AnisoConfig(metrics=(), load_entry_points=False), **paths)])  # fmt: skip
    module = LitLM()
    with pytest.raises(SetupError, match="targets='causal'"):
        trainer.fit(module, loader())
    assert "forward" not in module.model.lm_head.__dict__ and not module.model.lm_head._forward_hooks


class LitMaskedLM(pl.LightningModule):
    """A transformers BertForMaskedLM inside a LightningModule (labels -100 except masked positions)."""

    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertForMaskedLM

        torch.manual_seed(0)
        self.bert = BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                               intermediate_size=32, max_position_embeddings=16))  # fmt: skip

    def training_step(self, batch, batch_idx):
        return self.bert(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_default_targets_follow_the_hf_models_loss_masked_lm_and_packed_rows(tmp_path):
    def masked(items):
        batch = torch.utils.data.default_collate(items)
        labels = torch.full_like(batch["labels"], -100)
        labels[:, 2::3] = batch["labels"][:, 2::3]
        return {"input_ids": batch["input_ids"], "labels": labels}

    observer = Observer()
    cb = AnisoCallback(AnisoConfig(metrics=(), load_entry_points=False), [observer])
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[cb])  # fmt: skip
    data = loader()
    trainer.fit(LitMaskedLM(), torch.utils.data.DataLoader(data.dataset, batch_size=4, collate_fn=masked))
    (targets,) = observer.targets
    assert (targets[:, 2::3] != -100).all() and (targets[:, 0::3] == -100).all()  # unshifted, as BERT's loss

    def packed(items):  # two examples of 4 tokens per row, position_ids restarting (the documented key)
        batch = torch.utils.data.default_collate(items)
        batch["position_ids"] = torch.arange(8).remainder(4).expand(len(items), 8)
        return batch

    observer = Observer()
    cb = AnisoCallback(AnisoConfig(metrics=(), load_entry_points=False), [observer], **PATHS)
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[cb])  # fmt: skip
    trainer.fit(LitLM(), torch.utils.data.DataLoader(data.dataset, batch_size=4, collate_fn=packed))
    assert observer.steps[0].sequence_ids.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]] * 4
