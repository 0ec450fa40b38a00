"""`EndOfTrainingReport`: ``report_at_end=True`` — when training ends, the offline report
(`aniso_plugins.offline.report.write_report`) of the trained model's input embedding and head
into ``<output dir>/aniso_report``, on the main process only."""

from __future__ import annotations

import os

from torch import nn

from aniso_plugins.core.hookspecs import hookimpl
from aniso_plugins.core.model import ModelHandle
from aniso_plugins.core.plugin_base import Plugin
from aniso_plugins.core.plugins import logger
from aniso_plugins.offline.report import write_report

REPORT_DIR = "aniso_report"


class EndOfTrainingReport(Plugin):
    name = "report"

    @hookimpl
    def aniso_end_training(self, output_dir: str, main_process: bool) -> None:
        """Write the report on the main process. A monitoring path: a failure is a warning
        (e.g. FSDP2-sharded weights, a missing plotting extra), never an error."""
        if not main_process or not self.is_set_up:
            return
        directory = os.path.join(os.fspath(output_dir), REPORT_DIR)
        try:
            write_report(_EmbeddingsView(self.model), directory, name="final")
        except Exception as e:
            logger.warning("aniso_plugins: the end-of-training report was not written to %s (%s: %s)", directory, type(e).__name__, e)
            return
        logger.info("aniso_plugins: end-of-training report written to %s", directory)


class _EmbeddingsView(nn.Module):
    """The model's input embedding and head, seen through the transformers accessor names that
    the report reads (a handle may name them by submodule path)."""

    def __init__(self, handle: ModelHandle) -> None:
        super().__init__()
        self.__dict__["handle"] = handle  # not a registered submodule

    def get_input_embeddings(self) -> nn.Module | None:
        return self.handle.input_embedding()

    def get_output_embeddings(self) -> nn.Module:
        return self.handle.head()


__all__ = ["REPORT_DIR", "EndOfTrainingReport"]
