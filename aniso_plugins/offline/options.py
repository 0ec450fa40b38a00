"""The options of the end-of-training report (docs/report.md): fields of `aniso_plugins.AnisoConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from aniso_plugins.core.options import Options


@dataclass(frozen=True)
class ReportOptions(Options):
    """The offline report, written by the training run itself."""

    report_at_end: bool = False
    """At the end of training, write the offline report of the trained model's embedding and
    head (`aniso_plugins.offline.report`: report.json, report.md and the plots; docs/report.md) into
    ``<output dir>/aniso_report`` (HF: ``args.output_dir``, Lightning: the trainer's
    ``default_root_dir``), on the main process. Plots need ``aniso-plugins[report]``."""


__all__ = ["ReportOptions"]
