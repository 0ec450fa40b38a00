"""The HF Trainer adapter with a real transformers.Trainer on tiny models (CPU)."""

from __future__ import annotations

import glob
import math
import json
import os
import subprocess
import sys
import types

import pytest
import torch
from transformers import Trainer, TrainingArguments

import aniso_plugins
from aniso_plugins import AnisoConfig, SetupError
from aniso_plugins.integrations.hf import AnisoCallback
from references import agg_first_step_grad, regularizer_grad
from hf_utils import VOCAB, ForwardCapture, GradCapture, TokenDataset, tiny_gpt2, tiny_llama
from third_party_plugin import HeadNormPlugin

HERE = os.path.dirname(os.path.abspath(__file__))
QUIET = dict(report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no", seed=0, data_seed=0)


def make_trainer(tmp_path, config=None, plugins=(), model=None, callbacks=(), **args):
    kw = dict(QUIET, output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, learning_rate=1e-2)
    kw.update(args)
    cb = AnisoCallback(config or AnisoConfig(metrics=(), load_entry_points=False), plugins=plugins)
    trainer = Trainer(
        model=model if model is not None else tiny_gpt2(), args=TrainingArguments(**kw),
        train_dataset=TokenDataset(), callbacks=[cb, *callbacks],
    )
    return trainer, cb


def test_loss_term_reaches_gradients_once_per_step_under_accumulation(tmp_path):
    grads = {}
    for coef in (0.0, 0.25):
        cap = GradCapture(("transformer.wte.weight",))
        trainer, _ = make_trainer(
            tmp_path, plugins=[HeadNormPlugin(coef)], callbacks=[cap], gradient_accumulation_steps=3,
            max_grad_norm=0.0,
        )
        w0 = trainer.model.transformer.wte.weight.detach().clone()
        trainer.train()
        grads[coef] = cap.grads[0]["transformer.wte.weight"]
    # d/dW coef·‖W‖² = 2·coef·W, added once for the 3 micro-batches of the step
    torch.testing.assert_close(grads[0.25] - grads[0.0], 2 * 0.25 * w0, rtol=1e-4, atol=1e-6)


def test_loss_terms_follow_the_fp16_grad_scaler(tmp_path):
    class Scaler(torch.amp.GradScaler):  # what accelerate holds under fp16 AMP (on CUDA)
        def scale(self, loss):  # leave the loss unscaled: only the term's scaling is visible
            super().scale(loss.detach())  # (initializes the scale)
            return loss

    grads = {}
    for coef in (0.0, 0.25):
        cap = GradCapture(("transformer.wte.weight",))
        trainer, _ = make_trainer(tmp_path, plugins=[HeadNormPlugin(coef)], callbacks=[cap], max_grad_norm=0.0)
        trainer.accelerator.scaler = Scaler("cpu", init_scale=8.0)
        w0 = trainer.model.transformer.wte.weight.detach().clone()
        trainer.train()
        grads[coef] = cap.grads[0]["transformer.wte.weight"]
    torch.testing.assert_close(grads[0.25] - grads[0.0], 8.0 * 2 * 0.25 * w0, rtol=1e-4, atol=1e-6)


def test_loss_term_is_in_the_gradient_that_clipping_sees(tmp_path):
    def run(max_grad_norm):
        cap = GradCapture()
        trainer, _ = make_trainer(tmp_path, plugins=[HeadNormPlugin(5.0)], callbacks=[cap], max_grad_norm=max_grad_norm)
        trainer.train()
        return cap.grads[0]

    unclipped, clipped = run(0.0), run(1e-3)
    norm = torch.sqrt(sum(g.double().norm() ** 2 for g in unclipped.values()))
    for name, g in unclipped.items():  # clipping scaled the whole gradient, term included
        torch.testing.assert_close(clipped[name].double(), g.double() * (1e-3 / norm), rtol=1e-4, atol=1e-9)


def test_agg_first_step_gradient_equals_three_logit_reference(tmp_path):
    alpha = 1.5  # at step 1, a_k = count of k in the step: tokens seen once are rare, unseen ones too
    cap_mle = GradCapture(("transformer.wte.weight",))
    trainer, _ = make_trainer(tmp_path, callbacks=[cap_mle], max_grad_norm=0.0)
    trainer.train()

    cap = GradCapture(("transformer.wte.weight",))
    cfg = AnisoConfig(method="agg", alpha=alpha, window=4, metrics=(), load_entry_points=False)
    model = tiny_gpt2()
    w0 = model.transformer.wte.weight.detach().clone()
    seen = ForwardCapture(model)
    trainer, cb = make_trainer(tmp_path, cfg, model=model, callbacks=[cap], max_grad_norm=0.0)
    trainer.train()

    mle = cap_mle.grads[0]["transformer.wte.weight"]
    expected = agg_first_step_grad(mle, seen.hidden[0], w0, seen.labels[0], alpha, VOCAB)
    got = cap.grads[0]["transformer.wte.weight"].double()
    assert not torch.allclose(expected, mle.double(), rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("method", ["cosreg", "hinge", "spectrum"])
def test_regularizer_gradient_equals_reference_once_per_step(tmp_path, method):
    grads = {}
    for m in ("none", method):
        cap = GradCapture(("transformer.wte.weight",))
        cfg = AnisoConfig(method=m, reg_weight=0.3, hinge_margin=0.1, metrics=(), load_entry_points=False)
        trainer, _ = make_trainer(tmp_path, cfg, callbacks=[cap], max_grad_norm=0.0, gradient_accumulation_steps=2)
        w0 = trainer.model.transformer.wte.weight.detach().clone()
        trainer.train()
        grads[m] = cap.grads[0]["transformer.wte.weight"].double()
    expected = 0.3 * regularizer_grad(method, w0, margin=0.1)
    assert expected.abs().max() > 1e-6
    torch.testing.assert_close(grads[method] - grads["none"], expected, rtol=1e-4, atol=1e-7)


def test_metrics_reach_tensorboard_with_the_trainer_step(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    cfg = AnisoConfig(metrics=(), load_entry_points=False)
    trainer, _ = make_trainer(
        tmp_path, cfg, plugins=[HeadNormPlugin(1e-3)], max_steps=4, logging_steps=2, report_to="tensorboard"
    )
    trainer.train()
    events = glob.glob(str(tmp_path / "tb" / "**" / "events.out.tfevents.*"), recursive=True)
    assert events
    acc = EventAccumulator(os.path.dirname(events[0]))
    acc.Reload()
    tag = "train/aniso/head_norm/rms_row_norm"
    assert tag in acc.Tags()["scalars"] and "train/aniso/loss/head_l2" in acc.Tags()["scalars"]
    assert [e.step for e in acc.Scalars(tag)] == [2, 4]
    rows = [r for r in trainer.state.log_history if "aniso/head_norm/rms_row_norm" in r]
    assert [r["step"] for r in rows] == [2, 4]
    w = trainer.model.lm_head.weight.detach().double()
    assert rows[-1]["aniso/head_norm/rms_row_norm"] == pytest.approx(float(w.pow(2).sum(1).mean().sqrt()), rel=1e-9)


def test_metrics_every_logs_on_its_own_steps(tmp_path):
    cfg = AnisoConfig(metrics=(), metrics_every=3, load_entry_points=False)
    trainer, _ = make_trainer(tmp_path, cfg, plugins=[HeadNormPlugin(1e-3)], max_steps=6, logging_steps=4)
    trainer.train()
    steps = [r["step"] for r in trainer.state.log_history if "aniso/head_norm/rms_row_norm" in r]
    assert steps == [3, 6]
    assert [r["step"] for r in trainer.state.log_history if "loss" in r] == [4]


def _train_agg(tmp_path, max_steps, resume=None, save_steps=2):
    cfg = AnisoConfig(method="agg", alpha=0.5, window=3, metrics=(), load_entry_points=False)
    trainer, cb = make_trainer(
        tmp_path, cfg, max_steps=max_steps, save_strategy="steps", save_steps=save_steps, learning_rate=5e-2,
        lr_scheduler_type="constant", per_device_train_batch_size=2,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, cb


def test_resume_equals_uninterrupted_run(tmp_path):
    straight, _ = _train_agg(tmp_path / "a", max_steps=6)
    _train_agg(tmp_path / "b", max_steps=3, save_steps=3)
    assert os.path.exists(tmp_path / "b" / "checkpoint-3" / "aniso_state.safetensors")
    resumed, cb = _train_agg(tmp_path / "b", max_steps=6, resume=True, save_steps=3)
    for (name, p), (_, q) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), name
    # the counter was restored, not restarted: same state as the straight run
    a = next(c for c in straight.callback_handler.callbacks if isinstance(c, AnisoCallback)).session.plugins.state_dict()
    b = cb.session.plugins.state_dict()
    for ns in a:
        for k in a[ns]:
            assert torch.equal(a[ns][k], b[ns][k]), (ns, k)


def test_untie_head_keeps_config_consistent_and_reloads(tmp_path):
    model = tiny_llama(tied=True)
    trainer, _ = make_trainer(tmp_path, AnisoConfig(head="untie", metrics=(), load_entry_points=False), model=model)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.config.tie_word_embeddings is False
    trainer.train()
    model.tie_weights()
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    model.save_pretrained(tmp_path / "saved")
    again = type(model).from_pretrained(tmp_path / "saved")
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)
    assert not torch.equal(again.lm_head.weight, again.model.embed_tokens.weight)


def _kernel_forward(self, input_ids=None, labels=None, **kwargs):
    hidden = self.transformer(input_ids).last_hidden_state
    return torch.nn.functional.cross_entropy(torch.matmul(hidden, self.lm_head.weight.T).flatten(0, 1), labels.flatten())


def test_errors_before_any_step(tmp_path):
    from transformers import GPT2Model, GPT2Config

    with pytest.raises(SetupError, match="get_output_embeddings"):
        Trainer(
            model=GPT2Model(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=VOCAB)),
            args=TrainingArguments(output_dir=str(tmp_path), **QUIET),
            callbacks=[AnisoCallback(AnisoConfig(metrics=(), load_entry_points=False))],
        )
    with pytest.raises(SetupError, match="'cosreg' acts in the LM head's forward.*silently do nothing"):
        model = tiny_gpt2()  # a forward patched to hand the head's weight to a kernel (tests/test_head_bypass.py)
        model.forward = types.MethodType(_kernel_forward, model)
        Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), **QUIET),
                callbacks=[AnisoCallback(AnisoConfig(method="cosreg", metrics=(), load_entry_points=False))])

    class NoLabels(TokenDataset):
        def __getitem__(self, i):
            return {"input_ids": self.ids[i]}

    trainer = Trainer(
        model=tiny_gpt2(), args=TrainingArguments(output_dir=str(tmp_path), max_steps=1, **QUIET),
        train_dataset=NoLabels(), callbacks=[AnisoCallback(AnisoConfig(metrics=(), load_entry_points=False))],
    )
    w = trainer.model.lm_head.weight.detach().clone()
    with pytest.raises(SetupError, match="no 'labels'"):
        trainer.train()
    assert torch.equal(trainer.model.lm_head.weight, w)


@pytest.mark.slow
def test_two_process_ddp(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([HERE, os.path.join(HERE, "..", "examples")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(HERE, "hf_ddp_script.py"), str(tmp_path)]
    subprocess.run(cmd, check=True, env=env, timeout=300, capture_output=True)
    r = [json.load(open(tmp_path / f"rank{i}.json")) for i in range(2)]
    assert r[0]["gates"] == r[1]["gates"] and r[0]["rare"] == r[1]["rare"]
    assert r[0]["metrics"] == r[1]["metrics"] and r[0]["metrics"]
    # the loss term is counted once: with DDP averaging, its gradient is 2·coef·W, not world·2·coef·W
    for rank in r:
        torch.testing.assert_close(torch.tensor(rank["term_grad"]), torch.tensor(rank["expected_term_grad"]), rtol=1e-4, atol=1e-6)


def test_evaluate_reports_group_perplexity_and_uniq(tmp_path):
    cfg = AnisoConfig(metrics=("eval",), load_entry_points=False)
    trainer, _ = make_trainer(tmp_path, cfg, max_steps=3, per_device_eval_batch_size=4)
    trainer.eval_dataset = TokenDataset(n=8, seed=1)
    trainer.train()
    metrics = trainer.evaluate()
    # independent: the Trainer's own loss (equal-size batches: mean of batch means = token mean)
    assert metrics["eval_aniso/eval/ppl"] == pytest.approx(math.exp(metrics["eval_loss"]), rel=1e-5)
    ids = trainer.eval_dataset.ids
    with torch.no_grad():
        predicted = trainer.model(input_ids=ids).logits[:, :-1].argmax(-1)
    assert metrics["eval_aniso/eval/uniq"] == len(set(predicted.flatten().tolist()))
    groups = [metrics[f"eval_aniso/eval/uniq_{g}"] for g in ("rare", "medium", "frequent")]
    assert sum(groups) == metrics["eval_aniso/eval/uniq"]
    assert "eval_aniso/eval/ppl_rare" in trainer.state.log_history[-1]


def test_report_at_end_writes_the_trained_geometry(tmp_path):
    import json

    import numpy as np

    trainer, _ = make_trainer(tmp_path, AnisoConfig(report_at_end=True, metrics=(), load_entry_points=False), max_steps=2)
    trainer.train()
    folder = tmp_path / "aniso_report"
    report = json.loads((folder / "report.json").read_text())
    assert (folder / "report.md").exists() and list(folder.glob("*.png"))
    for png in folder.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the tied matrix's mean cosine, against an explicit pairwise formula in float64
    w = trainer.model.transformer.wte.weight.detach().double().numpy()
    u = w / np.linalg.norm(w, axis=1, keepdims=True)
    c = u @ u.T
    expected = (c.sum() - np.trace(c)) / (len(w) * (len(w) - 1))
    found = [v for k, v in _flatten(report) if k.endswith("raw/mean_cosine")]
    assert found and min(abs(f - expected) for f in found) < 1e-9


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}/{k}" if prefix else str(k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _flatten(v, f"{prefix}/{i}")
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield prefix, float(tree)


def test_masked_lm_targets_are_the_labels_unshifted(tmp_path):
    """A masked LM's logits are aligned with its labels (the Trainer shifts only causal LMs): the
    plugins must see the masked positions where they are, not one to the left."""
    from transformers import BertConfig, BertForMaskedLM

    seen: list[torch.Tensor] = []

    class Targets:
        name = "targets_probe"

        @aniso_plugins.hookimpl
        def aniso_targets(self, targets, step):
            seen.append(targets.clone())

    class Masked(TokenDataset):
        def __getitem__(self, i):
            labels = torch.full_like(self.ids[i], -100)
            labels[2::3] = self.ids[i][2::3]  # every third position is "masked"
            return {"input_ids": self.ids[i], "labels": labels}

    model = BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=32, max_position_embeddings=64))
    data = Masked()
    trainer = Trainer(
        model=model, args=TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, **QUIET),
        train_dataset=data,
        callbacks=[AnisoCallback(AnisoConfig(metrics=(), load_entry_points=False), plugins=[Targets()])],
    )
    trainer.train()
    (targets,) = seen
    assert (targets[:, 2::3] != -100).all() and (targets[:, 0::3] == -100).all() and (targets[:, 1::3] == -100).all()
    rows = {tuple(data[i]["labels"].tolist()) for i in range(len(data))}
    assert all(tuple(row.tolist()) in rows for row in targets)
