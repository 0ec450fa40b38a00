"""One HF training run for the kill tests (tests/test_reliability.py): AGG, a checkpoint every
3 steps, ``save_total_limit=1``. With ``--pause-at POINT --pause-step N`` it stops at that point
of step N's save, writes ``<output>/paused`` and sleeps until the test kills it (SIGKILL).

Points, in the order a save runs them: ``state-tmp`` (our state file written, not yet renamed),
``model-save`` (before the Trainer writes the model), ``rotate`` (the checkpoint is complete,
the previous one not yet deleted), ``after-rotate`` (the previous one is gone, ``on_save`` not
yet called). With ``--resume`` it resumes from the newest checkpoint and runs to the end; it
writes ``<output>/final.pt`` (weights and plugin state)."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import transformers.trainer as hf_trainer  # noqa: E402
from hf_utils import TokenDataset, tiny_gpt2  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from aniso_plugins import AnisoConfig  # noqa: E402
from aniso_plugins.integrations.hf import AnisoCallback  # noqa: E402


def pause(output: str) -> None:
    with open(os.path.join(output, "paused"), "w") as f:
        f.write("1")
    while True:
        time.sleep(1)


def install_pause(point: str, step: int, output: str, trainer: Trainer) -> None:
    at_step = lambda: trainer.state.global_step == step  # noqa: E731
    if point == "state-tmp":
        import aniso_plugins.core.state as state

        save_file = state.save_file

        def paused_save(tensors, path, metadata=None):
            save_file(tensors, path, metadata=metadata)
            if at_step():
                pause(output)

        state.save_file = paused_save
    elif point == "model-save":
        save_model = trainer.save_model

        def paused_model(*args, **kwargs):
            if at_step():
                pause(output)
            return save_model(*args, **kwargs)

        trainer.save_model = paused_model
    elif point in ("rotate", "after-rotate"):
        rotate = hf_trainer.rotate_checkpoints

        def paused_rotate(*args, **kwargs):
            if at_step() and point == "rotate":
                pause(output)
            rotate(*args, **kwargs)
            if at_step() and point == "after-rotate":
                pause(output)

        hf_trainer.rotate_checkpoints = paused_rotate
    else:
        raise SystemExit(f"unknown pause point {point!r}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output")
    parser.add_argument("--pause-at")
    parser.add_argument("--pause-step", type=int, default=6)
    parser.add_argument("--resume", action="store_true")
    a = parser.parse_args()
    config = AnisoConfig(method="agg", alpha=0.5, window=3, metrics=(), load_entry_points=False)
    callback = AnisoCallback(config)
    args = TrainingArguments(
        output_dir=a.output, report_to="none", use_cpu=True, disable_tqdm=True, seed=0, data_seed=0,
        per_device_train_batch_size=2, max_steps=9, learning_rate=5e-2, lr_scheduler_type="constant",
        save_strategy="steps", save_steps=3, save_total_limit=1,
    )
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(), callbacks=[callback])
    if a.pause_at:
        install_pause(a.pause_at, a.pause_step, a.output, trainer)
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    final = {"params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()}}
    final["state"] = callback.session.state_dict()["plugins"]
    torch.save(final, os.path.join(a.output, "final.pt"))


if __name__ == "__main__":
    main()
