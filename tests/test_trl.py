"""TRL's SFTTrainer (trl 1.x, real) with AnisoCallback: its fused LM head runs through the model's
head (integrations/hf/trl.py). References are written out here in float64 from what the run fed
its head: the head's input and the labels of the fused call."""

from __future__ import annotations

import math

import peft
import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from aniso_plugins import AnisoConfig
from aniso_plugins.integrations.hf import AnisoCallback
from aniso_plugins.integrations.hf.trl import fused_outputs_from_logits
from hf_utils import tiny_llama
from references import agg_output_grad, regularizer_grad
from word_data import VOCAB, texts, tokenizer

trl = pytest.importorskip("trl")

ALPHA = 2.5  # at step 1 a token is rare when it is a target fewer than 2.5 times in the step


def dataset(mode: str) -> Dataset:
    lines = texts()
    if mode == "completion":
        return Dataset.from_dict({"prompt": [s[: len(s) // 2] for s in lines], "completion": [s[len(s) // 2 :] for s in lines]})
    return Dataset.from_dict({"text": lines})


def sft_config(tmp_path, mode: str, **kw) -> trl.SFTConfig:
    return trl.SFTConfig(**{
        "output_dir": str(tmp_path), "max_steps": 1, "per_device_train_batch_size": 4, "report_to": "none",
        "use_cpu": True, "disable_tqdm": True, "save_strategy": "no", "seed": 0, "data_seed": 0, "bf16": False,
        "max_grad_norm": 0.0, "learning_rate": 1e-2, "logging_steps": 1, "max_length": 32,
        "packing": mode == "packing", "completion_only_loss": mode == "completion", **kw,
    })  # fmt: skip


class Fed:
    """What a training step fed: the labels of the model's call, its head's input, and the head
    weight's gradient right before the optimizer step."""

    def __init__(self, model: torch.nn.Module, head: torch.nn.Module):
        self.labels: list[torch.Tensor] = []
        self.hidden: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.head = head
        model.register_forward_pre_hook(self._labels, with_kwargs=True)
        head.register_forward_pre_hook(self._hidden)

    def _labels(self, module, args, kwargs):
        if module.training and torch.is_grad_enabled():
            self.labels.append(kwargs["labels"].detach().clone())

    def _hidden(self, module, args):
        if module.training and torch.is_grad_enabled():
            self.hidden.append(args[0].detach().clone())

    def callback(self) -> TrainerCallback:
        fed = self

        class Grads(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                fed.grads.append(fed.head.weight.grad.detach().clone())

        return Grads()

    def targets(self, step: int = 0) -> torch.Tensor:
        """The step's causal targets at every head position (the fused loss's shift)."""
        return F.pad(self.labels[step][:, 1:], (0, 1), value=-100).reshape(-1)


def build(mode: str):
    """An untied tiny Llama (a PEFT LoRA model with the head in modules_to_save for "peft") and
    its head module."""
    model = tiny_llama(vocab=len(VOCAB), tied=False)
    if mode != "peft":
        return model, model.lm_head
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                       task_type="CAUSAL_LM", modules_to_save=["lm_head"]))  # fmt: skip
    return model, model.base_model.model.lm_head.modules_to_save["default"]


def sft(tmp_path, mode: str, config: AnisoConfig | None, **kw):
    model, head = build(mode)
    weight = head.weight.detach().clone()
    fed = Fed(model, head)
    callbacks = [fed.callback()] + ([AnisoCallback(config)] if config is not None else [])
    trainer = trl.SFTTrainer(model=model, args=sft_config(tmp_path, "completion" if mode == "completion" else mode, **kw),
                             train_dataset=dataset(mode), processing_class=tokenizer(), callbacks=callbacks)  # fmt: skip
    trainer.train()
    return trainer, fed, weight


def cfg(**kw) -> AnisoConfig:
    return AnisoConfig(**{"metrics": (), "load_entry_points": False, **kw})


@pytest.mark.parametrize("mode", ["plain", "packing", "completion", "peft"])
def test_agg_on_sft_trainer_gates_the_head_gradient_as_the_float64_reference(tmp_path, mode):
    trainer, fed, weight = sft(tmp_path, mode, cfg(method="agg", alpha=ALPHA, window=2, metrics=("geometry",)))
    targets = fed.targets()
    valid = targets[targets != -100]
    if mode == "completion":  # the prompt's positions are not trained
        assert len(valid) < (fed.labels[0][:, 1:] != 0).sum()
    if mode == "packing":
        assert fed.labels[0].shape[0] == 1  # padding-free: one packed row
    counts = torch.bincount(valid, minlength=len(VOCAB)).double()
    assert ((counts > 0) & (counts < ALPHA)).any() and (counts == 0).any()  # rare targets and unseen columns
    expected = agg_output_grad(fed.hidden[0].reshape(-1, 16), weight, targets, counts, ALPHA, gated=True)
    torch.testing.assert_close(fed.grads[0].double(), expected, rtol=1e-4, atol=1e-6)
    plain = agg_output_grad(fed.hidden[0].reshape(-1, 16), weight, targets, counts, ALPHA, gated=False)
    assert (expected - plain).abs().max() > 1e-3  # the gates change this gradient
    record = trainer.state.log_history[0]
    assert "aniso/geometry/head/isotropy" in record and {"entropy", "mean_token_accuracy", "loss"} <= set(record)


def test_sft_loss_and_trl_metrics_are_unchanged_by_the_route_through_the_head(tmp_path):
    """With geometry metrics only, SFTTrainer's logged loss, entropy and accuracy equal TRL's own
    fused head's (no callback), and so does the head gradient."""
    routed, fed, _ = sft(tmp_path / "a", "plain", cfg(metrics=("geometry",)))
    own, fed_own, _ = sft(tmp_path / "b", "plain", None)
    for key in ("loss", "entropy", "mean_token_accuracy", "num_tokens"):
        assert routed.state.log_history[0][key] == pytest.approx(own.state.log_history[0][key], rel=1e-5), key
    torch.testing.assert_close(fed.grads[0], fed_own.grads[0], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("method", ["agg", "cosreg"])
def test_head_methods_keep_sft_trainers_chunked_path_and_its_logged_values(tmp_path, method):
    """A head method on SFTTrainer: the head answers TRL's fused call chunk by chunk (its training
    output is one log-probability per position, never the (B, T, V) logits), and the step's loss,
    entropy, accuracy and token count equal the plain SFTTrainer's (the first step's forward is
    the same model's)."""
    shapes: list[tuple[int, ...]] = []
    model, head = build("plain")
    head.register_forward_hook(lambda m, a, out: shapes.append(tuple(out.shape)) if m.training else None)
    config = cfg(method=method, alpha=ALPHA, window=2) if method == "agg" else cfg(method=method, reg_weight=0.7)
    trainer = trl.SFTTrainer(model=model, args=sft_config(tmp_path / "a", "plain"), train_dataset=dataset("plain"),
                             processing_class=tokenizer(), callbacks=[AnisoCallback(config)])  # fmt: skip
    assert trainer.callback_handler.callbacks and any(isinstance(c, AnisoCallback) and c.session.head_computes_loss
                                                      for c in trainer.callback_handler.callbacks)
    trainer.train()
    own, _, _ = sft(tmp_path / "b", "plain", None)
    assert shapes and all(len(shape) == 2 for shape in shapes), shapes  # (B, T): no vocabulary dimension
    for key in ("loss", "entropy", "mean_token_accuracy", "num_tokens"):
        assert trainer.state.log_history[0][key] == pytest.approx(own.state.log_history[0][key], rel=1e-5), key


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_cosreg_on_sft_trainer_adds_the_regularizer_gradient(tmp_path, loss_type):
    """On TRL's chunked path, whatever per-token weights TRL's loss puts on the log-probabilities
    (DFT: p(y) of each token, detached), the head gradient is TRL's plus exactly CosReg's."""
    _, fed, weight = sft(tmp_path / "a", "plain", cfg(method="cosreg", reg_weight=0.7), loss_type=loss_type)
    _, fed_plain, _ = sft(tmp_path / "b", "plain", None, loss_type=loss_type)
    expected = fed_plain.grads[0].double() + 0.7 * regularizer_grad("cosreg", weight)
    torch.testing.assert_close(fed.grads[0].double(), expected, rtol=1e-4, atol=1e-6)


class OneBatch(torch.utils.data.Dataset):
    """The batch an SFTTrainer step trained on, as a dataset of one item for a plain Trainer."""

    def __init__(self, batch: dict[str, torch.Tensor]):
        self.batch = batch

    def __len__(self):
        return 1

    def __getitem__(self, i):
        return self.batch


@pytest.mark.parametrize("method", ["simctg", "uniformity"])
def test_contrastive_methods_on_sft_trainer_equal_the_trainer_on_the_same_batch(tmp_path, method):
    """SimCTG and uniformity through SFTTrainer give the gradients and logged terms of a plain
    transformers.Trainer run on the very batch SFTTrainer collated."""
    batches: list[dict[str, torch.Tensor]] = []
    model = tiny_llama(vocab=len(VOCAB), tied=False)
    trainer = trl.SFTTrainer(model=model, args=sft_config(tmp_path / "sft", "plain"), train_dataset=dataset("plain"),
                             processing_class=tokenizer(), callbacks=[AnisoCallback(cfg(method=method))])  # fmt: skip
    step = trainer.training_step
    trainer.training_step = lambda m, inputs, n=None: (batches.append({k: v.clone() for k, v in inputs.items()}), step(m, inputs, n))[1]
    params = {}
    trainer.add_callback(_GradsOf(params))
    trainer.train()
    sft_grads = dict(params)

    reference = tiny_llama(vocab=len(VOCAB), tied=False)
    batch = {k: v for k, v in batches[0].items() if k in ("input_ids", "attention_mask", "labels")}
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=1, per_device_train_batch_size=1, report_to="none",
                             use_cpu=True, disable_tqdm=True, save_strategy="no", max_grad_norm=0.0, learning_rate=1e-2,
                             logging_steps=1)  # fmt: skip
    hf = Trainer(model=reference, args=args, train_dataset=OneBatch(batch), data_collator=lambda items: items[0],
                 callbacks=[AnisoCallback(cfg(method=method))])  # fmt: skip
    params.clear()
    hf.add_callback(_GradsOf(params))
    hf.train()
    assert sft_grads.keys() == params.keys() and "lm_head.weight" in params
    for name, grad in params.items():
        torch.testing.assert_close(sft_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    sft_record, hf_record = trainer.state.log_history[0], hf.state.log_history[0]
    (term,) = [k for k in hf_record if k.startswith(f"aniso/loss/{method}")]
    assert term in sft_record and sft_record[term] == pytest.approx(hf_record[term], rel=1e-5)


class _GradsOf(TrainerCallback):
    def __init__(self, into: dict[str, torch.Tensor]):
        self.into = into

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.into.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def test_evaluate_on_sft_trainer_measures_the_eval_logits(tmp_path):
    """Evaluation runs SFTTrainer's fused call through the head: the eval metrics see the logits
    (perplexity = exp of TRL's own eval loss, one batch) and the eval loss is TRL's."""
    routed, _, _ = sft(tmp_path / "a", "plain", cfg(metrics=("eval",)), per_device_eval_batch_size=32)
    scores = routed.evaluate(dataset("plain"))
    own, _, _ = sft(tmp_path / "b", "plain", None, per_device_eval_batch_size=32)
    assert scores["eval_loss"] == pytest.approx(own.evaluate(dataset("plain"))["eval_loss"], rel=1e-5)
    assert scores["eval_aniso/eval/ppl"] == pytest.approx(math.exp(scores["eval_loss"]), rel=1e-5)


def test_fused_outputs_from_logits_equal_an_explicit_float64_loop():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[3, 1, -100, 4, 6], [-100, 2, 2, 0, -100]])
    got = fused_outputs_from_logits(logits, labels, None, None)
    for b in range(2):
        for t in range(4):
            y = int(labels[b, t + 1])
            p = torch.softmax(logits[b, t].double(), -1)
            want = (float(torch.log(p[y])), float(-(p * p.log()).sum()), bool(p.argmax() == y)) if y != -100 else (0.0, 0.0, False)
            assert float(got["log_probs"][b, t]) == pytest.approx(want[0], abs=1e-5)
            assert float(got["entropy"][b, t]) == pytest.approx(want[1], abs=1e-5)
            assert bool(got["is_top1"][b, t]) == want[2] and bool(got["label_mask"][b, t]) == (y != -100)
    assert float(got["loss"]) == pytest.approx(-float(got["log_probs"].sum()) / 6, rel=1e-6)  # 6 labelled targets


def test_a_trl_older_than_the_floor_is_refused_at_construction(tmp_path, monkeypatch):
    """TRL 1.9 (Axolotl 0.19.0's pin) trains SFTTrainer's loss from lm_head.weight by a route the
    methods never see (before this check: AGG raised at the end of step 1); refused at
    ``SFTTrainer(...)``, naming the floor, with the model untouched."""
    from aniso_plugins import SetupError

    monkeypatch.setattr(trl, "__version__", "1.9.0")
    model, head = build("text")
    before = dict(model.named_modules())
    with pytest.raises(SetupError, match=r"TRL 1\.9\.0's SFTTrainer is not supported: .*pip install 'trl>=1\.16'"):
        trl.SFTTrainer(model=model, args=sft_config(tmp_path, "text"), train_dataset=dataset("text"),
                       processing_class=tokenizer(), callbacks=[AnisoCallback(cfg(method="agg"))])
    assert dict(model.named_modules()) == before and model.lm_head is head
