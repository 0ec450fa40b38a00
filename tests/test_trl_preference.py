"""TRL's preference and RL trainers (DPO, KTO, GRPO, RLOO; trl 1.x, real) with AnisoCallback:
metrics only. Their losses score the completions from ``lm_head.weight`` with TRL's fused LM head
and build their labels inside the loss, so each micro-batch's targets are read from the policy's
fused call; the methods, which act in the head's forward, are refused naming why. References in
float64: the head's geometry after the step and the frequency groups of the labels the policy's
fused calls scored (numpy, `test_metric_plugins`)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from datasets import Dataset

from aniso_plugins import AnisoConfig, SetupError
from aniso_plugins.integrations.hf import AnisoCallback
from hf_utils import tiny_llama
from test_geometry import ref_isotropy
from test_metric_plugins import GROUP_NAMES, ref_geometry, ref_groups
from test_reliability import assert_unchanged, fingerprint
from word_data import VOCAB, tokenizer

trl = pytest.importorskip("trl")

COMMON = dict(report_to="none", use_cpu=True, bf16=False, max_steps=1, logging_steps=1, save_strategy="no",
              disable_tqdm=True, seed=0, data_seed=0, learning_rate=1e-2, max_grad_norm=0.0)
PROMPTS = ["w1 w2 w3", "w3 w4", "w5 w1 w2", "w2 w6", "w7 w8 w1", "w4 w4"]


def _reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _trainer(kind: str, tmp_path, config: AnisoConfig, model):
    callbacks = [AnisoCallback(config)]
    kw = dict(model=model, processing_class=tokenizer(), callbacks=callbacks)
    if kind == "dpo":
        data = Dataset.from_dict({"prompt": PROMPTS, "chosen": [" w4 w5"] * 6, "rejected": [" w6 w7 w8"] * 6})
        args = trl.DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, **COMMON)
        return trl.DPOTrainer(args=args, train_dataset=data, ref_model=copy.deepcopy(model), **kw)
    if kind == "kto":
        data = Dataset.from_dict({"prompt": PROMPTS, "completion": [" w4 w5", " w6", " w7 w8", " w1", " w2 w2", " w3"],
                                  "label": [True, False, True, False, True, False]})
        args = trl.KTOConfig(output_dir=str(tmp_path), per_device_train_batch_size=6, **COMMON)
        return trl.KTOTrainer(args=args, train_dataset=data, ref_model=copy.deepcopy(model), **kw)
    cls, config_cls = (trl.GRPOTrainer, trl.GRPOConfig) if kind == "grpo" else (trl.RLOOTrainer, trl.RLOOConfig)
    args = config_cls(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=4, beta=0.0, **COMMON)
    return cls(args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}), reward_funcs=_reward, **kw)


class ScoredLabels:
    """The labels of the policy's fused calls with gradients (what the loss trains on)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.labels: list[torch.Tensor] = []
        model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        if kwargs.get("fused_lm_head") and module.training and torch.is_grad_enabled():
            self.labels.append(kwargs["labels"].detach().clone())


KINDS = ["dpo", "kto", "grpo", "rloo"]


@pytest.mark.parametrize("kind", KINDS)
def test_metrics_of_preference_and_rl_trainers_equal_float64_references(tmp_path, kind):
    model = tiny_llama(vocab=len(VOCAB), tied=False)
    scored = ScoredLabels(model)
    trainer = _trainer(kind, tmp_path, AnisoConfig(metrics=("geometry", "frequency"), load_entry_points=False), model)
    trainer.train()
    record = next(r for r in trainer.state.log_history if "aniso/geometry/head/isotropy" in r)
    w = model.lm_head.weight.detach().double().numpy()
    for key, ref in ref_geometry(w).items():
        assert record[f"aniso/geometry/head/{key}"] == pytest.approx(float(ref), rel=1e-5, abs=1e-7), key
    assert scored.labels  # the policy's fused calls were seen
    targets = torch.cat([y[:, 1:].reshape(-1) for y in scored.labels]).numpy()
    counts = np.bincount(targets[targets != -100], minlength=len(VOCAB))
    groups = ref_groups(counts)
    checked = 0
    for index, group in enumerate(GROUP_NAMES):
        rows = w[groups == index]
        if len(rows) >= 2:
            assert record[f"aniso/frequency/{group}/isotropy"] == pytest.approx(ref_isotropy(rows), rel=1e-5), group
            checked += 1
    assert checked >= 2


@pytest.mark.parametrize("method", ["agg", "cosreg"])
def test_methods_are_refused_in_dpo_naming_why_and_the_model_is_untouched(tmp_path, method):
    model = tiny_llama(vocab=len(VOCAB), tied=False)
    before = fingerprint(model)
    with pytest.raises(SetupError, match=f"'{method}' acts in the LM head's forward, which TRL's DPOTrainer bypasses"):
        _trainer("dpo", tmp_path, AnisoConfig(method=method, metrics=(), load_entry_points=False), model)
    assert_unchanged(before, model)
