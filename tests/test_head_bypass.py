"""Forwards that compute the loss from the LM head's weight without calling the head (TRL's fused
LM head, Liger-Kernel's ``lce_forward``, Cut Cross-Entropy's and Axolotl's patches) are refused at
``Trainer(...)`` for every method that acts in the head's forward (it would silently do nothing),
naming the patch; metrics-only runs go on. No architecture of the model zoo is mistaken for one."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments
from transformers.modeling_outputs import CausalLMOutputWithPast

from aniso_plugins import AnisoConfig, SetupError
from aniso_plugins.integrations.hf import AnisoCallback
from aniso_plugins.models.head_bypass import head_bypass_in_forward
from hf_utils import tiny_llama
from zoo import ARCHS

HEAD_METHODS = ["agg", "cosreg", "spectrum", "simctg", "uniformity"]


def fused_kernel(hidden, weight, labels):
    """A stand-in fused loss (what Liger's and Cut Cross-Entropy's kernels compute)."""
    return F.cross_entropy((hidden[:, :-1] @ weight.T).flatten(0, 1), labels[:, 1:].flatten())


def cce_style_forward(self, input_ids=None, labels=None, **kwargs):
    """Cut Cross-Entropy's patch: the head's weight handed to the kernel."""
    hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
    if self.training and labels is not None:
        return CausalLMOutputWithPast(loss=fused_kernel(hidden, self.lm_head.weight, labels), logits=None)
    return CausalLMOutputWithPast(loss=None, logits=self.lm_head(hidden))


def helper_style_forward(self, input_ids=None, labels=None, **kwargs):
    """Liger's pattern: the forward hands ``self`` to a helper that hands the head to the kernel."""
    hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
    return CausalLMOutputWithPast(loss=head_loss(self, hidden, labels), logits=None)


def head_loss(self, hidden, labels):
    lm_head = self.get_output_embeddings()
    return loss_of(lm_head, hidden, labels)


def loss_of(head, hidden, labels):
    return fused_kernel(hidden, head.weight, labels)


def _trl_patched(model):
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model)
    return model


PATCHES = {
    "cce_style": lambda m: setattr(m, "forward", types.MethodType(cce_style_forward, m)) or m,
    "helper_style": lambda m: setattr(m, "forward", types.MethodType(helper_style_forward, m)) or m,
    "trl_fused_lm_head": _trl_patched,
}


def _trainer(tmp_path, model, config):
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, report_to="none",
                             use_cpu=True, save_strategy="no", disable_tqdm=True, logging_steps=1)
    return Trainer(model=model, args=args, train_dataset=data, callbacks=[AnisoCallback(config)])


@pytest.mark.parametrize("patch", list(PATCHES))
@pytest.mark.parametrize("method", HEAD_METHODS)
def test_a_forward_that_bypasses_the_head_is_refused_at_trainer_construction(tmp_path, patch, method):
    model = PATCHES[patch](tiny_llama(vocab=64, tied=False))
    forward = model.forward
    config = AnisoConfig(method=method, metrics=(), load_entry_points=False)
    with pytest.raises(SetupError) as error:
        _trainer(tmp_path, model, config)
    message = str(error.value)
    assert f"'{method}'" in message and "silently do nothing" in message and "fused_loss=True" in message
    assert "lm_head" in message
    assert model.forward == forward and TrainingHeadless(model)  # nothing was left installed


def TrainingHeadless(model) -> bool:  # noqa: N802 - reads as the condition it checks
    return "forward" not in model.lm_head.__dict__ and not model.lm_head._forward_hooks and not model.lm_head._forward_pre_hooks


@pytest.mark.parametrize("patch", ["cce_style", "trl_fused_lm_head"])
def test_metrics_only_runs_with_a_bypassing_forward(tmp_path, patch):
    model = PATCHES[patch](tiny_llama(vocab=64, tied=False))
    trainer = _trainer(tmp_path, model, AnisoConfig(metrics=("geometry",), load_entry_points=False))
    if patch == "cce_style":
        trainer.train()
        assert any("aniso/geometry/head/isotropy" in record for record in trainer.state.log_history)


def test_the_patterns_are_named_with_their_code():
    model = tiny_llama(vocab=64, tied=False)
    assert head_bypass_in_forward(model, "lm_head") is None  # transformers' own forward calls its head
    found = head_bypass_in_forward(PATCHES["helper_style"](model), "lm_head")
    assert found is not None and "loss_of" in found and "test_head_bypass" in found


def test_trls_fused_lm_head_is_named_with_its_code():
    found = head_bypass_in_forward(_trl_patched(tiny_llama(vocab=64, tied=False)), "lm_head")
    assert found is not None and "trl.trainer.utils" in found and "_fused_forward" in found


@pytest.mark.parametrize("arch", list(ARCHS))
def test_no_architecture_of_the_zoo_is_taken_for_a_bypass(arch):
    model = ARCHS[arch].build()
    head = model.get_output_embeddings()
    attribute = next((key for key, module in model._modules.items() if module is head), "")
    assert head_bypass_in_forward(model, attribute) is None


def test_a_bypass_the_code_does_not_show_raises_at_the_first_step(tmp_path):
    """A forward whose bypass the static reading cannot see (a closure over the model, not
    ``self``): the regularizer's term was due in the head's forward, which never ran in training,
    so the first step raises instead of training on without it."""
    model = tiny_llama(vocab=64, tied=False)

    def forward(input_ids=None, labels=None, **kwargs):
        hidden = model.model(input_ids=input_ids).last_hidden_state
        return CausalLMOutputWithPast(loss=fused_kernel(hidden, model.lm_head.weight, labels), logits=None)

    model.forward = forward
    trainer = _trainer(tmp_path, model, AnisoConfig(method="cosreg", metrics=(), load_entry_points=False))
    with pytest.raises(SetupError, match="step 1: 'cosreg' add loss terms in the LM head's training forward, which did not run"):
        trainer.train()
