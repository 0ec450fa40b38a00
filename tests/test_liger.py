"""Liger-Kernel (0.8.x, real) beside aniso_plugins' methods: its fused linear cross-entropy,
asked for through ``TrainingArguments(use_liger_kernel=True)`` or applied by hand to the model
instance, is answered by aniso_plugins' fused loss through the LM head (Liger's other kernels
stay), so AGG and the regularizers train exactly as without Liger; a class-wide patch and a model
whose loss the fused loss cannot reproduce are refused at ``Trainer(...)`` naming the setting.

Liger's Triton kernels cannot run without a GPU: these runs ask for the fused linear
cross-entropy and turn Liger's other kernels off (no Triton launch); Liger's own fused loss (a
metrics-only run keeps it) is not run here."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from aniso_plugins import AnisoConfig, SetupError
from aniso_plugins.integrations.hf import AnisoCallback
from hf_utils import tiny_llama

liger = pytest.importorskip("liger_kernel.transformers")

OTHERS_OFF = {"rope": False, "rms_norm": False, "swiglu": False, "cross_entropy": False}
VOCAB = 64


def cfg(method: str) -> AnisoConfig:
    extra = {"alpha": 2.5, "window": 2} if method == "agg" else {"reg_weight": 0.7}
    return AnisoConfig(method=method, metrics=(), load_entry_points=False, **extra)


class HeadGrad(TrainerCallback):
    def __init__(self, head: torch.nn.Module) -> None:
        self.head, self.grads = head, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads.append(self.head.weight.grad.detach().clone())


def run(tmp_path, model, config, **liger_args):
    ids = torch.randint(0, VOCAB, (8, 12), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    grads = HeadGrad(model.lm_head)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8, report_to="none",
                             use_cpu=True, save_strategy="no", disable_tqdm=True, max_grad_norm=0.0, **liger_args)
    callback = AnisoCallback(config)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[grads, callback])
    return trainer, callback, grads


@pytest.mark.parametrize("method", ["agg", "cosreg"])
def test_use_liger_kernel_trains_the_methods_exactly_through_our_fused_loss(tmp_path, method):
    liger_config = {"fused_linear_cross_entropy": True, **OTHERS_OFF}
    trainer, callback, grads = run(tmp_path / "a", tiny_llama(vocab=VOCAB, tied=False), cfg(method),
                                   use_liger_kernel=True, liger_kernel_config=dict(liger_config))
    assert trainer.args.liger_kernel_config["fused_linear_cross_entropy"] is False  # set aside for the run
    assert callback.session.head_computes_loss  # our fused loss, chunk by chunk
    trainer.train()
    assert "forward" not in trainer.model.__dict__  # Liger's lce_forward was not applied
    plain, _, plain_grads = run(tmp_path / "b", tiny_llama(vocab=VOCAB, tied=False), cfg(method))
    plain.train()
    torch.testing.assert_close(grads.grads[0], plain_grads.grads[0], rtol=1e-6, atol=1e-8)
    callback.detach()
    assert trainer.args.liger_kernel_config == liger_config  # given back


def test_a_hand_applied_instance_patch_is_set_aside_for_the_run_and_given_back(tmp_path):
    model = tiny_llama(vocab=VOCAB, tied=False)
    liger.apply_liger_kernel_to_llama(model=model, fused_linear_cross_entropy=True, **OTHERS_OFF)
    patched = model.__dict__["forward"]
    trainer, callback, grads = run(tmp_path / "a", model, cfg("cosreg"))
    assert "forward" not in model.__dict__
    trainer.train()
    plain, _, plain_grads = run(tmp_path / "b", tiny_llama(vocab=VOCAB, tied=False), cfg("cosreg"))
    plain.train()
    torch.testing.assert_close(grads.grads[0], plain_grads.grads[0], rtol=1e-6, atol=1e-8)
    callback.detach()
    assert model.__dict__["forward"] is patched


def test_a_class_wide_patch_is_refused_naming_liger(tmp_path, monkeypatch):
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaForCausalLM, "forward", modeling_llama.LlamaForCausalLM.forward)
    liger.apply_liger_kernel_to_llama(fused_linear_cross_entropy=True, **OTHERS_OFF)
    with pytest.raises(SetupError, match="'cosreg' acts in the LM head's forward.*liger_kernel.*silently do nothing"):
        run(tmp_path, tiny_llama(vocab=VOCAB, tied=False), cfg("cosreg"))


def test_metrics_only_runs_keep_liger_untouched(tmp_path):
    liger_config = {"fused_linear_cross_entropy": True, **OTHERS_OFF}
    trainer, callback, _ = run(tmp_path, tiny_llama(vocab=VOCAB, tied=False),
                               AnisoConfig(metrics=("geometry",), load_entry_points=False),
                               use_liger_kernel=True, liger_kernel_config=dict(liger_config))
    assert trainer.args.liger_kernel_config == liger_config and not callback.session.head_computes_loss


def test_liger_with_a_loss_the_fused_loss_cannot_reproduce_is_refused_naming_the_setting(tmp_path):
    ids = torch.randint(0, VOCAB, (8, 12), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True,
                             use_liger_kernel=True, liger_kernel_config={"fused_linear_cross_entropy": True, **OTHERS_OFF})
    with pytest.raises(SetupError, match="Liger-Kernel's fused linear cross-entropy .*compute_loss_func.*liger_kernel_config"):
        Trainer(model=tiny_llama(vocab=VOCAB, tied=False), args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids],
                compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.logits.mean(),
                callbacks=[AnisoCallback(cfg("agg"))])
    assert args.liger_kernel_config["fused_linear_cross_entropy"] is True  # nothing half-applied
