"""One Lightning training run for the kill tests (tests/test_reliability.py): AGG, a checkpoint
at every epoch end (8 steps; a plain DataLoader resumes at epoch boundaries), ``save_top_k=1``.
With ``--pause-at POINT`` it stops at that point of the step-16 save, writes ``<output>/paused``
and sleeps until the test kills it. Points: ``write`` (the checkpoint, with the callback's state,
serialized but not yet written), ``remove`` (written, the previous one not yet deleted),
``after-remove``. With ``--resume`` it resumes from the newest checkpoint file and writes
``<output>/final.pt`` (weights and plugin state)."""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.fabric.plugins.io.torch_io as torch_io  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning_utils import LitLM, loader  # noqa: E402

from aniso_plugins import AnisoConfig  # noqa: E402
from aniso_plugins.integrations.lightning import AnisoCallback  # noqa: E402

PAUSE_STEP = 16


def pause(output: str) -> None:
    with open(os.path.join(output, "paused"), "w") as f:
        f.write("1")
    while True:
        time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output")
    parser.add_argument("--pause-at")
    parser.add_argument("--resume", action="store_true")
    a = parser.parse_args()
    callback = AnisoCallback(
        AnisoConfig(method="agg", alpha=0.5, window=3, metrics=(), load_entry_points=False),
        head="model.lm_head", input_embedding="model.embed", blocks="model.blocks", targets="causal",
    )
    ckpt = ModelCheckpoint(dirpath=os.path.join(a.output, "ck"), every_n_train_steps=8, save_top_k=1,
                           monitor="step", mode="max")
    trainer = pl.Trainer(accelerator="cpu", max_steps=24, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback, ckpt])
    at_step = lambda: trainer.global_step == PAUSE_STEP  # noqa: E731
    if a.pause_at == "write":
        atomic_save = torch_io._atomic_save

        def paused_save(checkpoint, path):
            if at_step():
                pause(a.output)
            atomic_save(checkpoint, path)

        torch_io._atomic_save = paused_save
    elif a.pause_at in ("remove", "after-remove"):
        remove = ckpt._remove_checkpoint

        def paused_remove(trainer_, filepath):
            if at_step() and a.pause_at == "remove":
                pause(a.output)
            remove(trainer_, filepath)
            if at_step() and a.pause_at == "after-remove":
                pause(a.output)

        ckpt._remove_checkpoint = paused_remove
    path = None
    if a.resume:
        files = glob.glob(os.path.join(a.output, "ck", "*.ckpt"))
        path = max(files, key=lambda f: torch.load(f, weights_only=False)["global_step"])
    trainer.fit(LitLM(), loader(), ckpt_path=path)
    final = {"params": {n: p.detach().clone() for n, p in trainer.lightning_module.named_parameters()}}
    final["state"] = callback.session.state_dict()["plugins"]
    torch.save(final, os.path.join(a.output, "final.pt"))


if __name__ == "__main__":
    main()
