"""`AnisoTrainerMixin` / `AnisoTrainer`: the HF adapter as a `Trainer` subclass, through the
callback's own methods (no instance patches)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from transformers import Trainer

from aniso_plugins import AnisoConfig
from aniso_plugins.integrations.hf.callback import AnisoCallback


class AnisoTrainerMixin:
    """The route transformers documents for changing the training loop, a `Trainer` subclass:
    ``class MyTrainer(AnisoTrainerMixin, Seq2SeqTrainer): ...`` or `AnisoTrainer`. It takes
    ``aniso=AnisoConfig(...)`` (and ``aniso_plugins=``, ``aniso_targets=``, ``aniso_head=``, as
    `AnisoCallback`'s ``plugins``, ``targets`` and ``head``) and does exactly what the callback does,
    through the callback's own methods, but overrides ``get_batch_samples``, ``training_step``,
    ``compute_loss``, ``prediction_step``, ``train`` and ``call_model_init`` in the class (nothing is replaced on
    the instance, no call stack is read) and sets up once ``Trainer.__init__`` has returned.
    ``self.aniso`` is its `AnisoCallback` (``self.aniso.session``, ``self.aniso.detach()``)."""

    def __init__(
        self,
        *args: Any,
        aniso: AnisoConfig | None = None,
        aniso_plugins: Iterable[object] = (),
        aniso_targets: Callable[[Any], torch.Tensor] | str | None = None,
        aniso_head: str | None = None,
        **kwargs: Any,
    ) -> None:
        self.aniso = AnisoCallback(aniso, aniso_plugins, targets=aniso_targets, head=aniso_head)
        self.aniso._owned = True
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), self.aniso]
        super().__init__(*args, **kwargs)
        self.aniso.attach(self)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.aniso.before_step(batch_samples)
        return batch_samples, num_items_in_batch

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.aniso.before_training_step(inputs)
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.aniso.supplying(model):
            return self.aniso.supplied_loss(self, model, inputs, return_outputs, num_items_in_batch)
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        with self.aniso.predicting(self, inputs):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        return super().train(self.aniso.resume_checkpoint(self, resume_from_checkpoint), *args, **kwargs)

    def call_model_init(self, trial=None):
        model = super().call_model_init(trial)
        if self.aniso.trainer is self:  # a model built by train(): set up before its optimizer exists
            self.aniso._set_up(model)
        return model


class AnisoTrainer(AnisoTrainerMixin, Trainer):
    """`transformers.Trainer` with aniso_plugins: ``AnisoTrainer(model=..., args=...,
    train_dataset=..., aniso=AnisoConfig(method="agg"))``; see `AnisoTrainerMixin`."""


__all__ = ["AnisoTrainer", "AnisoTrainerMixin"]
