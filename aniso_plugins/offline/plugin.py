"""`EndOfTrainingReport`: ``report_at_end=True`` — when training ends, the offline report
(`aniso_plugins.offline.report.write_report`) of the trained model's input embedding and head
into ``<output dir>/aniso_report``, on the main process only."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
from torch import nn

from aniso_plugins.core.hookspecs import hookimpl
from aniso_plugins.core.model import ModelHandle
from aniso_plugins.core.plugin_base import Plugin
from aniso_plugins.core.plugins import logger
from aniso_plugins.numerics.distributed import full_rows
from aniso_plugins.offline.report import write_report

REPORT_DIR = "aniso_report"


class EndOfTrainingReport(Plugin):
    name = "report"

    @hookimpl
    def aniso_end_training(self, output_dir: str, main_process: bool) -> None:
        """Write the report on the main process (every rank calls this: a sharded weight is
        gathered for it first). A monitoring path: a failure is a warning (e.g. a missing
        plotting extra), never an error."""
        if not self.is_set_up:
            return
        try:
            view = _EmbeddingsView(self.model)  # collective for DTensor weights: before the main-process test
        except Exception as e:
            logger.warning("aniso_plugins: the end-of-training report was not written (%s: %s)", type(e).__name__, e)
            return
        if not main_process:
            return
        directory = os.path.join(os.fspath(output_dir), REPORT_DIR)
        try:
            write_report(view, directory, name="final")
        except Exception as e:
            logger.warning("aniso_plugins: the end-of-training report was not written to %s (%s: %s)", directory, type(e).__name__, e)
            return
        logger.info("aniso_plugins: end-of-training report written to %s", directory)


class _EmbeddingsView(nn.Module):
    """The model's input embedding and head under the transformers accessor names that the
    report reads (a handle may name them by submodule path), each weight whole on this rank: a
    DTensor (FSDP2, tensor parallelism) all-gathered, so every rank must build it; ZeRO-3's and
    FSDP1's are gathered by the session around `aniso_end_training`. The head is the embedding
    where the two share their weight."""

    def __init__(self, handle: ModelHandle) -> None:
        super().__init__()
        head = SimpleNamespace(weight=full_rows(handle.head().weight.detach()))
        embedding = handle.input_embedding()
        if handle.tied():
            embedding = head
        elif embedding is not None and isinstance(getattr(embedding, "weight", None), torch.Tensor):
            embedding = SimpleNamespace(weight=full_rows(embedding.weight.detach()))
        self.__dict__["matrices"] = (embedding, head)  # not registered submodules

    def get_input_embeddings(self) -> SimpleNamespace | nn.Module | None:
        return self.matrices[0]

    def get_output_embeddings(self) -> SimpleNamespace:
        return self.matrices[1]


__all__ = ["REPORT_DIR", "EndOfTrainingReport"]
