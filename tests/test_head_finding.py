"""The LM head is the module that makes the logits, not whatever ``get_output_embeddings()``
returns: FSMT (the target embedding table there, an untied output_projection makes the logits),
DeBERTa-v2 with legacy=False (a 64x64 transform there, the logits are h·Eᵀ + b without a Linear),
ModernBERT with sparse_prediction=True (the head runs on the labelled rows only), and the HF
callback's ``head=`` option. References are float64 from what the run fed its head."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from transformers import Trainer, TrainerCallback, TrainingArguments

from aniso_plugins import AnisoConfig, SetupError
from aniso_plugins.integrations.hf import AnisoCallback
from references import agg_output_grad
from test_reliability import assert_unchanged, fingerprint
from zoo import ExplicitDecoderInputs, MaskedData, fsmt

VOCAB, IGNORE = 64, -100
QUIET = dict(report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no", seed=0, data_seed=0,
             max_grad_norm=0.0, max_steps=1, per_device_train_batch_size=4, logging_steps=1, learning_rate=1e-2)  # fmt: skip


def cfg(**kw) -> AnisoConfig:
    return AnisoConfig(**{"metrics": (), "load_entry_points": False, **kw})


class HeadFed(TrainerCallback):
    """The labels of the model's training call, its head module's input, and the head weight's
    gradient before the optimizer step."""

    def __init__(self, model: torch.nn.Module, head: torch.nn.Module):
        self.head, self.labels, self.hidden, self.grads = head, [], [], []
        model.register_forward_pre_hook(self._labels, with_kwargs=True)
        head.register_forward_pre_hook(lambda m, a: self.hidden.append(a[0].detach().clone()) if m.training else None)

    def _labels(self, module, args, kwargs):
        if module.training:
            self.labels.append(kwargs["labels"].detach().clone())

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads.append(self.head.weight.grad.detach().clone())


def train(tmp_path, model, data, config, head_module, **callback_kw):
    fed = HeadFed(model, head_module)
    weight = head_module.weight.detach().clone()
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), **QUIET), train_dataset=data,
                      callbacks=[AnisoCallback(config, **callback_kw), fed])  # fmt: skip
    trainer.train()
    return trainer, fed, weight


def test_fsmt_geometry_measures_the_projection_that_makes_the_logits(tmp_path):
    """FSMT's get_output_embeddings() is the decoder's token embedding (same shape); the head
    metrics are those of model.decoder.output_projection (float64 SVD of its weight)."""
    model = fsmt()
    projection, table = model.model.decoder.output_projection, model.get_output_embeddings()
    assert table is model.model.decoder.embed_tokens and table.weight.shape == projection.weight.shape
    sigma = torch.linalg.svdvals(projection.weight.detach().double())[0]
    assert abs(float(torch.linalg.svdvals(table.weight.detach().double())[0]) - float(sigma)) > 1e-3
    trainer, _, _ = train(tmp_path, model, ExplicitDecoderInputs(), cfg(metrics=("geometry",)), projection)
    # measured after the first update: the reference reads the weight the metric read
    sigma = torch.linalg.svdvals(projection.weight.detach().double())[0]
    assert trainer.state.log_history[0]["aniso/geometry/head/sigma_max"] == pytest.approx(float(sigma), rel=1e-6)


def test_fsmt_agg_with_the_head_named_explicitly_equals_the_reference(tmp_path):
    model = fsmt()
    projection = model.model.decoder.output_projection
    data = ExplicitDecoderInputs()
    _, fed, weight = train(tmp_path, model, data, cfg(method="agg", alpha=2.5, window=2), projection,
                           head="model.decoder.output_projection")  # fmt: skip
    targets = fed.labels[0].reshape(-1)  # seq2seq: the decoder's labels as they are
    counts = torch.bincount(targets[targets != IGNORE], minlength=VOCAB).double()
    expected = agg_output_grad(fed.hidden[0].reshape(-1, 16), weight, targets, counts, 2.5, gated=True)
    torch.testing.assert_close(fed.grads[0].double(), expected, rtol=1e-4, atol=1e-6)


def test_a_head_path_that_does_not_exist_is_refused_at_trainer_naming_it(tmp_path):
    model = fsmt()
    before = fingerprint(model)
    with pytest.raises(SetupError, match="no submodule 'model.decoder.head'"):
        Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), **QUIET), train_dataset=ExplicitDecoderInputs(),
                callbacks=[AnisoCallback(cfg(method="agg"), head="model.decoder.head")])  # fmt: skip
    assert_unchanged(before, model)


def deberta(legacy: bool):
    torch.manual_seed(0)
    return T.DebertaV2ForMaskedLM(T.DebertaV2Config(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, legacy=legacy, pad_token_id=0))  # fmt: skip


@pytest.mark.parametrize("config", [cfg(method="agg"), cfg(method="cosreg"), cfg(metrics=("geometry",))],
                         ids=["agg", "cosreg", "geometry"])
def test_deberta_v2_without_a_linear_head_is_refused_at_trainer_with_the_real_cause(tmp_path, config):
    model = deberta(legacy=False)
    before = fingerprint(model)
    with pytest.raises(SetupError, match=r"no module that makes its logits: get_output_embeddings\(\) is "
                                         r"'lm_predictions.lm_head.dense' .* legacy=True"):  # fmt: skip
        Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), **QUIET), train_dataset=MaskedData(),
                callbacks=[AnisoCallback(config)])  # fmt: skip
    assert_unchanged(before, model)


def test_deberta_v2_legacy_head_gets_agg_exactly(tmp_path):
    model = deberta(legacy=True)
    head = model.get_output_embeddings()
    assert isinstance(head, torch.nn.Linear) and head.out_features == VOCAB
    model.config.tie_word_embeddings = False
    head.weight = torch.nn.Parameter(head.weight.detach().clone())  # untied: the head's gradient alone
    _, fed, weight = train(tmp_path, model, MaskedData(), cfg(method="agg", alpha=2.5, window=2), head)
    targets = fed.labels[0].reshape(-1)  # masked LM: the labels as they are
    counts = torch.bincount(targets[targets != IGNORE], minlength=VOCAB).double()
    expected = agg_output_grad(fed.hidden[0].reshape(-1, 16), weight, targets, counts, 2.5, gated=True)
    torch.testing.assert_close(fed.grads[0].double(), expected, rtol=1e-4, atol=1e-6)


def modernbert():
    torch.manual_seed(0)
    return T.ModernBertForMaskedLM(T.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=32, sparse_prediction=True, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, attn_implementation="eager"))  # fmt: skip


def test_modernbert_sparse_prediction_agg_gates_the_labelled_rows_the_head_saw(tmp_path):
    model = modernbert()
    trainer, fed, weight = train(tmp_path, model, MaskedData(), cfg(method="agg", alpha=2.5, window=2,
                                 metrics=("frequency",)), model.decoder)  # fmt: skip
    labels = fed.labels[0].reshape(-1)
    targets = labels[labels != IGNORE]  # the rows ModernBERT keeps, in order
    hidden = fed.hidden[0]
    assert hidden.shape == (len(targets), 16)  # the head saw only the labelled rows
    counts = torch.bincount(targets, minlength=VOCAB).double()
    expected = agg_output_grad(hidden, weight, targets, counts, 2.5, gated=True)
    torch.testing.assert_close(fed.grads[0].double(), expected, rtol=1e-4, atol=1e-6)
    assert any(k.startswith("aniso/frequency/") for k in trainer.state.log_history[0])


def test_modernbert_sparse_prediction_refuses_simctg_at_trainer(tmp_path):
    model = modernbert()
    before = fingerprint(model)
    with pytest.raises(SetupError, match="labelled positions only .*sparse_prediction=False"):
        Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), **QUIET), train_dataset=MaskedData(),
                callbacks=[AnisoCallback(cfg(method="simctg"))])  # fmt: skip
    assert_unchanged(before, model)
