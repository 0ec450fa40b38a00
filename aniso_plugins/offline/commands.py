"""What the ``aniso`` subcommands do once their arguments are parsed (`aniso_plugins.offline.cli`
imports this module after parsing, so ``--help`` needs no torch and a Ctrl-C while torch loads is
one line): every argument and the output location checked before any work, then the work."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator

from aniso_plugins.offline.errors import ReportError
from aniso_plugins.offline.output import check_output_dir
from aniso_plugins.offline.render import MATPLOTLIB_HINT, has_matplotlib
from aniso_plugins.offline.report import MatrixOptions, TextOptions, analyze, check_counts
from aniso_plugins.offline.sentences import fit_sentence_transform


def check_report_args(a: argparse.Namespace) -> None:
    """Every argument and the output location, before any model is read (exit 2 on a bad one)."""
    check_counts(max_tokens=a.max_tokens, gram_rows=a.gram_rows)
    check_output_dir(a.out)
    for path, what in ((a.text_file, "text file"), (a.counts_file, "counts file")):
        if path is not None and not os.path.isfile(path):
            raise ReportError(f"cannot read the {what} {path}: no such file")
    for model in a.models:
        if not os.path.exists(model):
            raise ReportError(f"MODEL {model}: no such file or directory")


@contextlib.contextmanager
def warnings_on_stderr(command: str) -> Iterator[None]:
    """While the block runs, the package's logged warnings (e.g. a report section skipped) are
    ``aniso COMMAND: warning: ...`` lines on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter(f"aniso {command}: warning: %(message)s"))
    package = logging.getLogger("aniso_plugins")
    package.addHandler(handler)
    try:
        yield
    finally:
        package.removeHandler(handler)


def plots_wanted(a: argparse.Namespace) -> bool:
    """Whether to draw the plots: not with --no-plots, nor without matplotlib (then one warning:
    report.json and report.md are written all the same)."""
    if a.no_plots:
        return False
    if has_matplotlib():
        return True
    print(f"aniso report: warning: matplotlib is not installed, so the report has no plots ({MATPLOTLIB_HINT}; "
          "--no-plots skips them without this warning)", file=sys.stderr)
    return False


def report(a: argparse.Namespace) -> int:
    check_report_args(a)
    plots = plots_wanted(a)
    post = [x for x in (a.postprocess or "").split(",") if x.strip()]
    text = TextOptions(text_file=a.text_file, max_tokens=a.max_tokens, counts_file=a.counts_file)
    matrices = MatrixOptions(tensor=a.tensor, embedding=a.embedding, head=a.head, gram_rows=a.gram_rows)
    with warnings_on_stderr("report"):
        report = analyze(a.models, text, matrices, post, progress=not a.quiet, trust_checkpoint=a.trust_checkpoint)
    for m in report.models:
        if not a.quiet:  # what the report says about how a model was read; its warnings are logged
            for note in m.get("notes", []):
                if note not in m.get("_warnings", []):
                    print(f"aniso report: note: {m['name']}: {note}", file=sys.stderr)
        if m.get("text", {}).get("warning"):
            print(f"aniso report: warning: {m['name']}: {m['text']['warning']}", file=sys.stderr)
    paths = report.write(a.out, plots=plots)
    if a.json:
        sys.stdout.write(report.to_json() + "\n")
    if not a.quiet:
        print(f"aniso report: wrote {len(paths)} files to {a.out}", file=sys.stderr)
    return 0


def postprocess(a: argparse.Namespace) -> int:
    if a.k is not None and a.k < 1:
        raise ReportError(f"--k {a.k}: need an integer >= 1")
    for path, what in ((a.model, "MODEL"), (a.text_file, "text file")):
        if path is not None and not os.path.exists(path):
            raise ReportError(f"{what} {path}: no such file or directory")
    paths = fit_sentence_transform(a.model, a.text_file, a.transform, a.out, k=a.k, pooling=a.pooling)
    print(f"aniso postprocess: wrote {', '.join(paths)}", file=sys.stderr)
    return 0


COMMANDS = {"report": report, "postprocess": postprocess}
"""Subcommand -> its function (argparse namespace -> exit code)."""

__all__ = ["COMMANDS", "check_report_args", "plots_wanted", "postprocess", "report", "warnings_on_stderr"]
