"""The documented route for changing the HF training loop, a Trainer subclass (`AnisoTrainer`,
`AnisoTrainerMixin`): the same results as the one-line callback, with nothing replaced on the
Trainer instance."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, TrainingArguments

from aniso_plugins import AnisoConfig, SetupError
from aniso_plugins.integrations.hf import AnisoCallback, AnisoTrainer, AnisoTrainerMixin
from hf_utils import GradCapture, TokenDataset, tiny_gpt2
from test_hf_models import Pairs, tiny_t5
from test_reliability import assert_unchanged, fingerprint

QUIET = dict(report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no", seed=0, data_seed=0, max_grad_norm=0.0)


def cfg(**kw) -> AnisoConfig:
    return AnisoConfig(**{"metrics": ("geometry",), "load_entry_points": False, **kw})


def test_aniso_trainer_equals_the_callback_and_replaces_nothing_on_the_instance(tmp_path):
    runs = {}
    for route in ("callback", "subclass"):
        capture = GradCapture(("lm_head.weight",))
        args = TrainingArguments(output_dir=str(tmp_path / route), max_steps=2, per_device_train_batch_size=4,
                                 learning_rate=1e-2, logging_steps=1, **QUIET)  # fmt: skip
        config = cfg(method="agg", window=2, alpha=0.5, head="untie")
        if route == "callback":
            from transformers import Trainer

            trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(),
                              callbacks=[AnisoCallback(config), capture])  # fmt: skip
        else:
            trainer = AnisoTrainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(), callbacks=[capture],
                                   aniso=config)  # fmt: skip
            assert not {"training_step", "prediction_step", "train", "compute_loss"} & set(trainer.__dict__)
            assert trainer.model.lm_head.weight is not trainer.model.transformer.wte.weight  # set up at AnisoTrainer(...)
        trainer.train()
        runs[route] = (capture.grads, trainer.state.log_history)
    for a, b in zip(runs["callback"][0], runs["subclass"][0]):
        torch.testing.assert_close(a["lm_head.weight"], b["lm_head.weight"], rtol=0, atol=0)
    keys = [k for k in runs["callback"][1][0] if k.startswith("aniso/")]
    assert keys and all(runs["subclass"][1][0][k] == runs["callback"][1][0][k] for k in keys)


class Seq2SeqAnisoTrainer(AnisoTrainerMixin, Seq2SeqTrainer):
    pass


def test_the_mixin_on_seq2seq_trainer_evaluates_the_labelled_forward_under_generation(tmp_path):
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4,
                                    predict_with_generate=True, generation_max_length=6, **QUIET)  # fmt: skip
    trainer = Seq2SeqAnisoTrainer(model=tiny_t5(), args=args, train_dataset=Pairs(), eval_dataset=Pairs(4, seed=1),
                                  aniso=cfg(method="agg", window=2, metrics=("eval",)))  # fmt: skip
    trainer.train()
    metrics = trainer.evaluate()
    assert metrics["eval_aniso/eval/ppl"] == pytest.approx(math.exp(metrics["eval_loss"]), rel=1e-5)


def test_aniso_trainer_sets_up_models_of_model_init_and_refuses_before_changing_anything(tmp_path):
    built = []

    def model_init():
        built.append(tiny_gpt2())
        return built[-1]

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, **QUIET)
    trainer = AnisoTrainer(model_init=model_init, args=args, train_dataset=TokenDataset(),
                           aniso=cfg(method="agg", window=2, head="untie"))  # fmt: skip
    trainer.train()
    assert len(built) == 2 and trainer.aniso.session.handle.model is built[1]
    assert built[0].lm_head.weight is built[0].transformer.wte.weight  # the first model's set-up undone
    model = tiny_gpt2()
    before = fingerprint(model)
    with pytest.raises(SetupError, match="1 <= r < d"):
        AnisoTrainer(model=model, args=args, train_dataset=TokenDataset(), aniso=cfg(head="lowrank", lowrank_rank=99))
    assert_unchanged(before, model)
