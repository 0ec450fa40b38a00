"""Hugging Face Trainer adapter: one callback.

    from aniso_plugins import AnisoConfig
    from aniso_plugins.integrations.hf import AnisoCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[AnisoCallback(AnisoConfig(method="agg"))])

What the callback does with the Trainer (transformers 5.x; docs/design.md walks through it):

- ``on_init_end`` (inside ``Trainer.__init__``, before the optimizer exists and before
  accelerate wraps the model): callbacks are never handed the Trainer, so the callback finds
  the Trainer that is constructing it on the call stack (or use `attach(trainer)` for one
  built earlier), checks everything it can refuse, and sets up after every other callback's
  ``on_init_end`` has run, so a ``Trainer(...)`` that fails leaves the model as it was. Set-up:
  head surgery through `aniso_plugins.TrainingSession.setup`; (1) it moves itself right after
  ``DefaultFlowCallback``, before the reporters, so metrics it adds in ``on_log`` reach
  TensorBoard / W&B / every ``report_to``; (2) wraps the instance's ``training_step`` (sees
  each training micro-batch's labels before the forward, also when a ``compute_loss_func``
  later pops them) and ``prediction_step`` (evaluation labels; with ``predict_with_generate``
  the generation steps are not evaluation logits); (3) wraps ``train`` to learn which
  checkpoint a run resumes from, and ``model_init`` (hyperparameter search) to set up on every
  model the Trainer builds; (4) where a plugin reads each optimizer step's whole batch (AGG),
  wraps ``get_batch_samples``, which fetches a step's micro-batches before the first forward,
  to announce them all (`aniso_plugins.TrainingSession.begin_step`).
- TRL's ``SFTTrainer`` (a Trainer subclass): its fused LM head, which reads ``lm_head.weight``
  without calling the head, is run through the model's head (`trl.route_through_head`);
  TRL's other trainers are refused at construction.
- The LM head is the module that makes the logits
  (`aniso_plugins.models.handle.output_projection`), or the callback's ``head=`` path.
- Targets: as the model's own loss aligns them (`aniso_plugins.models.alignment.alignment_of`: causal
  LMs shifted, masked LMs and encoder-decoders' decoder labels as they are, ``shift_labels``
  when the collator gives them), or the callback's ``targets=``; packed batches
  (``DataCollatorWithFlattening``) are split into their examples by ``position_ids``
  (``seq_idx``, ``cu_seq_lens_q``). PEFT models are unwrapped to the base model's head.
- Loss terms are attached in the LM head's forward on the last micro-batch of each optimizer
  step: their gradient reaches the weights before clipping, once per step, and DDP averages
  identical per-rank contributions (no double counting).
- Metrics are measured on every rank at the Trainer's logging steps (or every ``metrics_every``
  steps) and added to the Trainer's log record (the printed one shows a summary: `patches.condense_printed_logs`);
  evaluation metrics after ``evaluate()`` under ``eval_aniso/...``.
- Plugin state is written to ``checkpoint-N/aniso_state.safetensors`` on save and restored
  at ``train(resume_from_checkpoint=...)``.
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError('aniso_plugins.integrations.hf needs transformers: pip install "aniso-plugins[hf]"') from e

from aniso_plugins.integrations.hf.callback import AnisoCallback, hf_handle
from aniso_plugins.integrations.hf.checkpoints import newest_complete_checkpoint
from aniso_plugins.integrations.hf.trainer import AnisoTrainer, AnisoTrainerMixin

__all__ = ["AnisoCallback", "AnisoTrainer", "AnisoTrainerMixin", "hf_handle", "newest_complete_checkpoint"]
