"""One Axolotl run from a YAML, as ``axolotl train`` builds it (``load_cfg``, ``load_datasets``,
``setup_model_and_trainer``: the plugins' schema, callbacks and trainer class), recording for the
tests what each step saw: every training micro-batch's labels and position_ids, the LM head's
input, the head's gradient before each optimizer step, the initial head, the log history and the
callbacks on the Trainer. Usage: python axolotl_script.py CONFIG.yml OUT.pt"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")  # no telemetry from a test
os.environ.setdefault("DO_NOT_TRACK", "1")

import torch  # noqa: E402
from axolotl.cli.config import load_cfg  # noqa: E402
from axolotl.common.datasets import load_datasets  # noqa: E402
from axolotl.train import setup_model_and_trainer  # noqa: E402
from transformers import TrainerCallback  # noqa: E402


class _Record(TrainerCallback):
    """The head's gradient right before each optimizer step; the micro-batches through hooks."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.head = model.get_output_embeddings()
        self.record: dict[str, list] = {"labels": [], "position_ids": [], "hidden": [], "grads": []}
        model.register_forward_pre_hook(self._inputs, with_kwargs=True)
        self.head.register_forward_pre_hook(self._hidden)

    def _inputs(self, module, args, kwargs):
        if module.training:
            self.record["labels"].append(kwargs["labels"].detach().clone())
            pos = kwargs.get("position_ids")
            self.record["position_ids"].append(None if pos is None else pos.detach().clone())

    def _hidden(self, module, args):
        if module.training:
            self.record["hidden"].append(args[0].detach().clone())

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.record["grads"].append(self.head.weight.grad.detach().clone())


def main(config: str, out: str) -> None:
    cfg = load_cfg(config)
    meta = load_datasets(cfg=cfg)
    trainer, model, *_ = setup_model_and_trainer(cfg, meta)
    record = _Record(model)
    trainer.add_callback(record)
    head0 = model.get_output_embeddings().weight.detach().clone()
    trainer.train()
    torch.save({**record.record, "head0": head0, "log_history": trainer.state.log_history,
                "trainer": type(trainer).__name__,
                "callbacks": [type(c).__name__ for c in trainer.callback_handler.callbacks]}, out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
