"""The models and Trainer paths users bring, through a real transformers Trainer: encoder-decoders
(Seq2SeqTrainer, predict_with_generate), padding-free packed batches, PEFT, model_init and
hyperparameter search, and a Trainer(...) that fails. References are written out here."""

from __future__ import annotations

import math
import os

import pytest
import torch
from transformers import (
    BartConfig,
    BartForCausalLM,
    DataCollatorWithFlattening,
    MarianConfig,
    MarianMTModel,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    T5Config,
    T5ForConditionalGeneration,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    XLNetConfig,
    XLNetLMHeadModel,
)

import aniso_plugins
from aniso_plugins import AnisoConfig, SetupError
from aniso_plugins.integrations.hf import AnisoCallback
from hf_utils import VOCAB, GradCapture, TokenDataset, tiny_gpt2, tiny_llama
from references import agg_output_grad, regularizer_grad
from test_reliability import assert_unchanged, fingerprint

QUIET = dict(report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no", seed=0, data_seed=0)
EXACT = dict(QUIET, max_grad_norm=0.0)  # gradients compared with references: no clipping


def cfg(**kw) -> AnisoConfig:
    return AnisoConfig(**{"metrics": (), "load_entry_points": False, **kw})


class HeadGrad(TrainerCallback):
    """The LM head weight's gradient right before each optimizer step (tied or not)."""

    def __init__(self):
        self.grads: list[torch.Tensor] = []
        self.model = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.model = model

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads.append(self.model.get_output_embeddings().weight.grad.detach().clone())


class TargetsProbe:
    """Records what the plugins are told of each training micro-batch."""

    name = "targets_probe"

    def __init__(self):
        self.seen: list[tuple[torch.Tensor, aniso_plugins.StepInfo]] = []
        self.models: list[torch.nn.Module] = []

    @aniso_plugins.hookimpl
    def aniso_setup(self, model, config):
        self.models.append(model.model)

    @aniso_plugins.hookimpl
    def aniso_targets(self, targets, step):
        self.seen.append((targets.clone(), step))


# --- encoder-decoders ------------------------------------------------------------------------------
class Pairs(torch.utils.data.Dataset):
    """Source/target id pairs (targets of another length than the sources), no padding."""

    def __init__(self, n: int = 8, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.src = torch.randint(3, VOCAB, (n, 7), generator=g)
        self.tgt = torch.randint(3, VOCAB, (n, 5), generator=g)

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        return {"input_ids": self.src[i], "attention_mask": torch.ones(7, dtype=torch.long), "labels": self.tgt[i]}


def tiny_t5(seed=0):
    torch.manual_seed(seed)
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                               num_decoder_layers=2, num_heads=2, dropout_rate=0.0,
                                               decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))  # fmt: skip


def tiny_marian(seed=0):
    torch.manual_seed(seed)
    return MarianMTModel(MarianConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=2,
                                      encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                      decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0, pad_token_id=0,
                                      eos_token_id=1, decoder_start_token_id=0))  # fmt: skip


@pytest.mark.parametrize("build", [tiny_t5, tiny_marian], ids=["t5", "marian"])
def test_encoder_decoder_agg_gates_the_decoder_labels_as_they_are(tmp_path, build):
    """The head gradient under AGG equals the gated reference on the decoder's own labels (it
    matched the causally shifted labels before: rel. err. 0.11 on T5, 0.13 on Marian)."""
    grads, mle = {}, {}
    for method in ("none", "agg"):
        model = build()
        probe, capture = TargetsProbe(), HeadGrad()
        hidden = []
        model.lm_head.register_forward_pre_hook(lambda m, a: hidden.append(a[0].detach().clone()) if m.training else None)
        args = Seq2SeqTrainingArguments(output_dir=str(tmp_path / method), max_steps=1, per_device_train_batch_size=4,
                                        learning_rate=1e-2, **EXACT)  # fmt: skip
        Seq2SeqTrainer(model=model, args=args, train_dataset=Pairs(),
                       callbacks=[AnisoCallback(cfg(method=method, window=2, alpha=0.5), [probe]), capture]).train()
        grads[method], mle[method] = capture.grads[0], (hidden[0], probe.seen[0][0], model)
    hidden, targets, model = mle["none"]
    rows = {tuple(r.tolist()) for r in Pairs().tgt}
    assert all(tuple(r.tolist()) in rows for r in targets)  # the plugins saw the decoder labels, unshifted
    counts = torch.bincount(targets.reshape(-1), minlength=VOCAB).double()
    h = hidden.reshape(-1, hidden.shape[-1])
    w = build().lm_head.weight  # the weights of the first forward
    plain = agg_output_grad(h, w, targets.reshape(-1), counts, 0.5, gated=False)
    gated = agg_output_grad(h, w, targets.reshape(-1), counts, 0.5, gated=True)
    # tied T5/Marian: the embedding lookup's part of the shared weight's gradient is AGG-free
    expected = grads["none"].double() - plain + gated
    assert (gated - plain).abs().max() > 1e-3  # the gates change the gradient in this batch
    torch.testing.assert_close(grads["agg"].double(), expected, rtol=1e-4, atol=1e-6)


def test_a_loss_term_keeps_its_share_where_the_trainer_scales_a_mean_loss(tmp_path):
    """T5's forward computes its micro-batch's mean loss (as Marian's, Bart's), but accepts **kwargs, so
    the Trainer takes the loss as divided by the step's target count: it skips the division by
    the accumulation steps and trains on GA times the mean. CosReg's term is weighted alike
    (GA · λ · ∇R); before, it got λ · ∇R, half its configured share at GA = 2."""
    grads, accumulation, weight = {}, 2, 0.7
    for method in ("none", "cosreg"):
        capture = HeadGrad()
        args = Seq2SeqTrainingArguments(output_dir=str(tmp_path / method), max_steps=1, per_device_train_batch_size=2,
                                        gradient_accumulation_steps=accumulation, learning_rate=1e-2, **EXACT)  # fmt: skip
        Seq2SeqTrainer(model=tiny_t5(), args=args, train_dataset=Pairs(),
                       callbacks=[AnisoCallback(cfg(method=method, reg_weight=weight)), capture]).train()  # fmt: skip
        grads[method] = capture.grads[0].double()
    expected = grads["none"] + accumulation * weight * regularizer_grad("cosreg", tiny_t5().lm_head.weight)
    torch.testing.assert_close(grads["cosreg"], expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("build", [tiny_t5, tiny_marian], ids=["t5", "marian"])
def test_seq2seq_trainer_evaluates_the_labelled_forward_with_and_without_generation(tmp_path, build):
    """Per-group perplexity comes from the decoder's logits of the labelled forward: equal to
    exp(eval_loss), and unchanged by predict_with_generate (whose generation steps also run
    the head); hidden-state metrics measure the decoder's blocks."""
    out = {}
    for generate in (False, True):
        model = build()
        args = Seq2SeqTrainingArguments(output_dir=str(tmp_path / str(generate)), max_steps=1, per_device_train_batch_size=4,
                                        predict_with_generate=generate, generation_max_length=6, logging_steps=1,
                                        **QUIET)  # fmt: skip
        cb = AnisoCallback(cfg(method="agg", window=2, metrics=("eval", "hidden")))
        trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=Pairs(), eval_dataset=Pairs(4, seed=1), callbacks=[cb])
        trainer.train()
        out[generate] = trainer.evaluate()
        assert len(cb.session.handle.blocks()) == 2  # the decoder's two blocks, not the encoder's
        assert "aniso/hidden/layer_1/mean_cosine" in trainer.state.log_history[0]
    for metrics in out.values():
        assert metrics["eval_aniso/eval/ppl"] == pytest.approx(math.exp(metrics["eval_loss"]), rel=1e-5)
    keys = [k for k in out[False] if k.startswith("eval_aniso/")]
    assert keys and all(out[True][k] == pytest.approx(out[False][k], rel=1e-6, nan_ok=True) for k in keys)


# --- packed batches ----------------------------------------------------------------------------------
class Ragged(torch.utils.data.Dataset):
    """Four examples of different lengths (lists, as a tokenizer gives them)."""

    lengths = (5, 7, 4, 6)

    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.ids = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in self.lengths]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def pad_collator(features):
    """The same examples, right-padded (attention mask, labels -100 at padding)."""
    length = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n], mask[i, :n], labels[i, :n] = torch.tensor(f["input_ids"]), 1, torch.tensor(f["labels"])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


PAIRING = ("aniso/loss/simctg", "aniso/ethayarajh/layer_0/intra_sim", "aniso/ethayarajh/layer_0/self_sim",
           "aniso/hidden/layer_0/mean_cosine", "aniso/uniformity/hidden")  # fmt: skip


@pytest.mark.parametrize("build", [tiny_gpt2, lambda: tiny_llama(tied=False)], ids=["gpt2", "llama"])
def test_packed_batch_equals_the_same_examples_padded(tmp_path, build):
    """Every term and metric that pairs positions gives on a packed row (DataCollatorWithFlattening:
    one row, position_ids restarting per example) what it gives on the same examples padded:
    SimCTG pairs and IntraSim sentences never cross examples (SimCTG matched the whole-row
    reference before: 0.07 off on GPT-2, 0.24 on Llama)."""
    logs = {}
    for name, collator in (("packed", DataCollatorWithFlattening()), ("padded", pad_collator)):
        config = cfg(method="simctg", simctg_weight=1.0, simctg_margin=0.9, metrics=("hidden", "ethayarajh", "uniformity"),
                     hidden_samples=1000)  # fmt: skip
        args = TrainingArguments(output_dir=str(tmp_path / name), max_steps=1, per_device_train_batch_size=4,
                                 logging_steps=1, **QUIET)  # fmt: skip
        trainer = Trainer(model=build(), args=args, train_dataset=Ragged(), data_collator=collator,
                          callbacks=[AnisoCallback(config)])  # fmt: skip
        trainer.train()
        logs[name] = trainer.state.log_history[0]
    for key in PAIRING:
        assert logs["packed"][key] == pytest.approx(logs["padded"][key], rel=1e-4, abs=1e-6), key
    assert logs["packed"]["aniso/loss/simctg"] > 0


# --- PEFT ----------------------------------------------------------------------------------------------
peft = pytest.importorskip("peft")


def lora(model, **kw):
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      task_type="CAUSAL_LM", **kw))  # fmt: skip


def peft_args(tmp_path, **kw):
    return TrainingArguments(**{**EXACT, "output_dir": str(tmp_path), "max_steps": 1, "per_device_train_batch_size": 4,
                                "learning_rate": 1e-2, "logging_steps": 1, **kw})  # fmt: skip


def test_peft_lora_with_the_head_in_modules_to_save_gets_agg_exactly(tmp_path):
    model = lora(tiny_llama(tied=False), modules_to_save=["lm_head"])
    head = model.base_model.model.lm_head.modules_to_save["default"]
    weight = head.weight.detach().clone()
    hidden, probe = [], TargetsProbe()
    head.register_forward_pre_hook(lambda m, a: hidden.append(a[0].detach().clone()) if m.training else None)
    capture = GradCapture(("base_model.model.lm_head.modules_to_save.default.weight",))
    trainer = Trainer(model=model, args=peft_args(tmp_path), train_dataset=TokenDataset(),
                      callbacks=[AnisoCallback(cfg(method="agg", window=2, alpha=0.5, metrics=("geometry",)), [probe]),
                                 capture])  # fmt: skip
    trainer.train()
    targets = probe.seen[0][0].reshape(-1)
    counts = torch.bincount(targets[targets != -100], minlength=VOCAB).double()
    expected = agg_output_grad(hidden[0].reshape(-1, 16), weight, targets, counts, 0.5, gated=True)
    (grad,) = capture.grads[0].values()
    torch.testing.assert_close(grad.double(), expected, rtol=1e-4, atol=1e-6)
    assert "aniso/geometry/head/isotropy" in trainer.state.log_history[0]


def test_peft_frozen_head_refuses_head_methods_at_trainer_and_still_measures(tmp_path):
    model = lora(tiny_llama(tied=False))
    before = fingerprint(model.base_model.model)
    for config in (cfg(method="agg", window=2), cfg(method="cosreg"), cfg(head="lowrank", lowrank_rank=4)):
        with pytest.raises(SetupError, match=r"frozen.*modules_to_save=\['lm_head'\]"):
            Trainer(model=model, args=peft_args(tmp_path), train_dataset=TokenDataset(), callbacks=[AnisoCallback(config)])
        assert_unchanged(before, model.base_model.model)
    trainer = Trainer(model=model, args=peft_args(tmp_path), train_dataset=TokenDataset(),
                      callbacks=[AnisoCallback(cfg(metrics=("geometry", "hidden")))])  # fmt: skip
    trainer.train()
    w = model.base_model.model.lm_head.weight.detach().double()
    u = w / w.norm(dim=1, keepdim=True)
    n = len(u)
    mean_cosine = float(((u @ u.T).sum() - n) / (n * (n - 1)))
    assert trainer.state.log_history[0]["aniso/geometry/head/mean_cosine"] == pytest.approx(mean_cosine, rel=1e-6)


def test_lora_on_the_head_is_refused_for_head_methods_and_measured_as_w_plus_delta(tmp_path):
    model = peft.get_peft_model(tiny_llama(tied=False), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"],
                                                                        task_type="CAUSAL_LM"))  # fmt: skip
    with pytest.raises(SetupError, match=r"LoRA on the head.*modules_to_save=\['lm_head'\]"):
        Trainer(model=model, args=peft_args(tmp_path), train_dataset=TokenDataset(),
                callbacks=[AnisoCallback(cfg(method="agg", window=2))])  # fmt: skip
    lm_head = model.base_model.model.lm_head
    torch.nn.init.normal_(lm_head.lora_B["default"].weight)  # a nonzero ΔW (LoRA starts at B = 0)
    trainer = Trainer(model=model, args=peft_args(tmp_path, learning_rate=0.0), train_dataset=TokenDataset(),
                      callbacks=[AnisoCallback(cfg(metrics=("geometry",)))])  # fmt: skip
    trainer.train()
    a, b = lm_head.lora_A["default"].weight.double(), lm_head.lora_B["default"].weight.double()
    w = lm_head.base_layer.weight.double() + (8 / 4) * b @ a  # W + (alpha / r) B A
    u = w / w.norm(dim=1, keepdim=True)
    n = len(u)
    mean_cosine = float(((u @ u.T).sum() - n) / (n * (n - 1)))
    assert trainer.state.log_history[0]["aniso/geometry/head/mean_cosine"] == pytest.approx(mean_cosine, rel=1e-5)


def _train_peft_agg(output_dir, max_steps, resume=False):
    model = lora(tiny_llama(tied=True), modules_to_save=["lm_head"])
    args = peft_args(output_dir, max_steps=max_steps, save_strategy="steps", save_steps=2, learning_rate=1e-2,
                     lr_scheduler_type="constant")  # fmt: skip
    cb = AnisoCallback(cfg(method="agg", window=3))
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(n=64), callbacks=[cb])
    trainer.train(resume_from_checkpoint=resume or None)
    return trainer, cb


def test_peft_state_sits_next_to_the_adapter_and_resume_and_merge_work(tmp_path):
    straight, cb_straight = _train_peft_agg(tmp_path / "a", 4)
    _train_peft_agg(tmp_path / "b", 2)
    checkpoint = tmp_path / "b" / "checkpoint-2"
    assert {"adapter_model.safetensors", "aniso_state.safetensors"} <= set(os.listdir(checkpoint))
    resumed, cb_resumed = _train_peft_agg(tmp_path / "b", 4, resume=True)
    for (name, p), (_, q) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), name
    a, b = cb_straight.session.plugins.state_dict(), cb_resumed.session.plugins.state_dict()
    assert all(torch.equal(a[ns][k], b[ns][k]) for ns in a for k in a[ns])
    model = resumed.model.eval()
    x = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        before = model(input_ids=x).logits
    cb_resumed.detach(keep_head=True)
    merged = model.merge_and_unload()
    assert fingerprint(merged)["forwards"] == []
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, before, rtol=1e-5, atol=1e-5)


# --- model_init and hyperparameter search ------------------------------------------------------------
def test_model_init_sets_up_every_model_the_trainer_builds(tmp_path):
    built = []

    def model_init():
        built.append(tiny_gpt2())
        return built[-1]

    probe, capture = TargetsProbe(), GradCapture(("lm_head.weight",))
    args = TrainingArguments(output_dir=str(tmp_path / "init"), max_steps=1, per_device_train_batch_size=4,
                             learning_rate=1e-2, **QUIET)  # fmt: skip
    trainer = Trainer(model_init=model_init, args=args, train_dataset=TokenDataset(),
                      callbacks=[AnisoCallback(cfg(method="agg", window=2, head="untie"), [probe]), capture])  # fmt: skip
    assert "forward" in built[0].lm_head.__dict__  # Trainer(...) set up on the model of __init__
    trainer.train()
    assert len(built) == 2 and probe.models == built and trainer.model is built[1]
    assert built[0].lm_head.weight is built[0].transformer.wte.weight  # the first model's set-up was undone
    assert "forward" not in built[0].lm_head.__dict__ and built[0].config.tie_word_embeddings is True
    assert built[1].lm_head.weight is not built[1].transformer.wte.weight  # surgery on the trained one
    # the same gradient as the model passed directly
    direct = GradCapture(("lm_head.weight",))
    args_direct = TrainingArguments(output_dir=str(tmp_path / "direct"), max_steps=1, per_device_train_batch_size=4,
                                    learning_rate=1e-2, **QUIET)  # fmt: skip
    Trainer(model=tiny_gpt2(), args=args_direct, train_dataset=TokenDataset(),
            callbacks=[AnisoCallback(cfg(method="agg", window=2, head="untie")), direct]).train()  # fmt: skip
    torch.testing.assert_close(capture.grads[0]["lm_head.weight"], direct.grads[0]["lm_head.weight"])


def test_hyperparameter_search_sets_up_each_trial(tmp_path):
    pytest.importorskip("optuna")
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    probe = TargetsProbe()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, logging_steps=1,
                             **QUIET)  # fmt: skip
    trainer = Trainer(model_init=lambda trial: tiny_gpt2(), args=args, train_dataset=TokenDataset(), eval_dataset=TokenDataset(n=8),
                      callbacks=[AnisoCallback(cfg(method="agg", window=2, metrics=("geometry",)), [probe])])  # fmt: skip
    best = trainer.hyperparameter_search(direction="minimize", backend="optuna", n_trials=2,
                                         hp_space=lambda t: {"learning_rate": t.suggest_float("lr", 1e-4, 1e-2)})
    assert best.run_id in ("0", "1")
    # the model of __init__ plus one per trial, each set up; every trial trained 2 steps with AGG's targets
    assert len(probe.models) == 3 and len({id(m) for m in probe.models}) == 3
    assert len(probe.seen) == 4
    assert "aniso/geometry/head/isotropy" in trainer.state.log_history[0]


# --- a Trainer(...) that fails leaves the model as it was -----------------------------------------------
class FailingInit(TrainerCallback):
    def on_init_end(self, args, state, control, **kwargs):
        raise RuntimeError("another callback fails")


@pytest.mark.parametrize("order", ["aniso_first", "aniso_last"])
def test_another_callback_failing_in_trainer_init_leaves_the_model_unchanged(tmp_path, order):
    model = tiny_gpt2()
    before = fingerprint(model)
    aniso = AnisoCallback(cfg(method="agg", window=2, head="untie"))
    callbacks = [aniso, FailingInit()] if order == "aniso_first" else [FailingInit(), aniso]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, **QUIET)
    with pytest.raises(RuntimeError, match="another callback fails"):
        Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=callbacks)
    assert_unchanged(before, model)
    Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[AnisoCallback(cfg(method="agg", window=2))]).train()


def test_a_model_whose_loss_convention_is_unknown_is_refused_at_trainer_naming_targets(tmp_path):
    from transformers import XLMConfig, XLMWithLMHeadModel

    model = XLMWithLMHeadModel(XLMConfig(vocab_size=VOCAB, emb_dim=16, n_layers=1, n_heads=2))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, **QUIET)
    with pytest.raises(SetupError, match="targets="):
        Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[AnisoCallback(cfg(method="agg", window=2))])
    probe = TargetsProbe()
    Trainer(model=model, args=args, train_dataset=TokenDataset(),
            callbacks=[AnisoCallback(cfg(method="agg", window=2), [probe], targets="aligned")]).train()  # fmt: skip
    targets, _ = probe.seen[0]
    rows = {tuple(r.tolist()) for r in TokenDataset().ids}
    assert all(tuple(r.tolist()) in rows for r in targets)  # the labels as they are


# --- a model that transforms the head's logits before its loss ------------------------------------------
def test_post_head_logit_transforms_evaluated_and_probed_as_the_model_computes_its_loss(tmp_path, caplog):
    """Gemma2 soft-caps the head's logits; the evaluation metrics read the model's own logits
    (they read the head's before: ppl 95.4 against exp(eval_loss) 70.4), and the update
    efficiency, which perturbs the head logits' cross-entropy, is NaN with a warning."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                           final_logit_softcapping=2.0, max_position_embeddings=32, pad_token_id=0))  # fmt: skip
    config = cfg(metrics=("eval", "bottleneck"), update_efficiency=True)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, logging_steps=1,
                             **QUIET)  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(), eval_dataset=TokenDataset(n=8, seed=1),
                      callbacks=[AnisoCallback(config)])  # fmt: skip
    with caplog.at_level("WARNING", logger="aniso_plugins"):
        trainer.train()
    metrics = trainer.evaluate()
    assert metrics["eval_aniso/eval/ppl"] == pytest.approx(math.exp(metrics["eval_loss"]), rel=1e-5)
    record = trainer.state.log_history[0]
    assert 0 < record["aniso/bottleneck/lost_fraction"] < 1  # the probe itself reads the true gradients
    assert record["aniso/bottleneck/update_efficiency/tokens"] == 0  # no probe rows
    assert math.isnan(record["aniso/bottleneck/update_efficiency/cos"])
    assert "changes the head's logits before its loss" in caplog.text


# --- causal-LM classes whose loss does not shift ------------------------------------------------
UNSHIFTED_CAUSAL_LMS = (
    "BartForCausalLM", "BigBirdPegasusForCausalLM", "BlenderbotForCausalLM", "BlenderbotSmallForCausalLM",
    "MarianForCausalLM", "MBartForCausalLM", "MvpForCausalLM", "PegasusForCausalLM", "PLBartForCausalLM",
    "TrOCRForCausalLM", "WhisperForCausalLM", "CpmAntForCausalLM", "XLNetLMHeadModel",
)
"""transformers 5.24's causal-LM classes whose forward computes CrossEntropyLoss(logits.view(-1, V),
labels.view(-1)) without a shift (read from their source; BartForCausalLM's docs: "The labels
are **not shifted** inside the model")."""


@pytest.mark.parametrize("name", UNSHIFTED_CAUSAL_LMS)
def test_causal_lm_classes_whose_loss_does_not_shift_get_aligned_targets(name):
    """transformers lists them as causal LMs; the targets follow their loss instead. Before, each
    was taken as shifted: AGG's gates and SimCTG's positions read labels[t+1]."""
    import transformers

    from aniso_plugins.core.targets import ALIGNED
    from aniso_plugins.models.alignment import alignment_of

    cls = getattr(transformers, name)
    model = cls.__new__(cls)  # the rule reads the class's forward; no weights needed
    listed = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
    assert name in {n for v in listed for n in ((v,) if isinstance(v, str) else v)}
    assert alignment_of(model) == ALIGNED


def tiny_bart_causal(seed=0):
    torch.manual_seed(seed)
    return BartForCausalLM(BartConfig(vocab_size=VOCAB, d_model=16, decoder_layers=1, decoder_attention_heads=2,
                                      decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0, pad_token_id=0,
                                      eos_token_id=1, bos_token_id=0, is_decoder=True, is_encoder_decoder=False))  # fmt: skip


def tiny_xlnet(seed=0):
    torch.manual_seed(seed)
    return XLNetLMHeadModel(XLNetConfig(vocab_size=VOCAB, d_model=16, n_layer=1, n_head=2, d_inner=32, dropout=0.0,
                                        pad_token_id=0, bos_token_id=0, eos_token_id=1))  # fmt: skip


@pytest.mark.parametrize("build", [tiny_bart_causal, tiny_xlnet], ids=["bart_causal", "xlnet"])
def test_agg_gates_an_unshifted_causal_lm_on_its_own_labels(tmp_path, build):
    """The head gradient under AGG equals the gated float64 reference on the labels as they are
    (it was 0.11 / 0.07 off before: the labels were shifted once more)."""
    grads = {}
    for method in ("none", "agg"):
        model = build()
        capture, hidden = HeadGrad(), []
        model.get_output_embeddings().register_forward_pre_hook(lambda m, a: hidden.append(a[0].detach().clone()) if m.training else None)
        args = TrainingArguments(output_dir=str(tmp_path / method), max_steps=1, per_device_train_batch_size=4,
                                 learning_rate=1e-2, **EXACT)  # fmt: skip
        Trainer(model=model, args=args, train_dataset=TokenDataset(n=4),
                callbacks=[AnisoCallback(cfg(method=method, window=2, alpha=2.0)), capture]).train()  # fmt: skip
        grads[method] = capture.grads[0].double()
    targets = TokenDataset(n=4).ids.reshape(-1)  # the labels as they are: the model does not shift them
    counts = torch.bincount(targets, minlength=VOCAB).double()
    h = hidden[0].reshape(-1, hidden[0].shape[-1])
    w = build().get_output_embeddings().weight
    plain = agg_output_grad(h, w, targets, counts, 2.0, gated=False)
    gated = agg_output_grad(h, w, targets, counts, 2.0, gated=True)
    assert (gated - plain).abs().max() > 1e-3  # the gates change the gradient in this batch
    torch.testing.assert_close(grads["agg"], grads["none"] - plain + gated, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("cls", ["ProphetNetForCausalLM", "ProphetNetForConditionalGeneration"])
def test_a_head_called_on_ngram_streams_is_refused_at_construction(tmp_path, cls):
    """ProphetNet calls its head once on (B, n-gram, T, d) and trains every stream on the same
    labels in its own `_compute_loss`: the targets cannot be read from its forward, so
    `Trainer(...)` refuses it naming ``targets=`` (before, AGG failed in step 1 with a raw
    "gated_linear: targets of shape (4, 16) do not match the positions of hidden (4, 2, 16)"; the
    seq2seq class was accepted as an encoder-decoder and failed so)."""
    import transformers
    from transformers import ProphetNetConfig

    model = getattr(transformers, cls)(ProphetNetConfig(
        vocab_size=VOCAB, hidden_size=16, encoder_ffn_dim=32, decoder_ffn_dim=32, num_encoder_layers=1,
        num_decoder_layers=1, num_encoder_attention_heads=2, num_decoder_attention_heads=2, ngram=2,
        max_position_embeddings=32, pad_token_id=0, eos_token_id=1, bos_token_id=0,
    ))  # fmt: skip
    before = fingerprint(model)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, **EXACT)
    with pytest.raises(SetupError, match=cls + r".*self\._compute_loss.*targets="):
        Trainer(model=model, args=args, train_dataset=TokenDataset(n=4), callbacks=[AnisoCallback(cfg(method="agg"))])
    assert_unchanged(before, model)
