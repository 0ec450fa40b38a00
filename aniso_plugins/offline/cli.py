"""The ``aniso`` command (docs/report.md).

    aniso --version
    aniso report MODEL [MODEL ...] [--text-file FILE] [--out DIR] [--max-tokens N]
                 [--postprocess centering,whitening] [--tensor NAME] [--quiet] [--json]
    aniso postprocess MODEL --text-file FILE --transform whitening [--k K] --out DIR

A thin layer over `aniso_plugins.offline.report.analyze`: bad input is one line on stderr
(``aniso report: error: ...``) and exit code 2; set ANISO_DEBUG=1 for the traceback. The console
script ``aniso`` and ``python -m aniso_plugins.offline.cli`` run ``sys.exit(main())``: `main`
without arguments is the process's own command, and a Ctrl-C after it has its exit code (the
output committed: 0) cannot change that code, up to the interpreter's exit.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from aniso_plugins.core.version import __version__
from aniso_plugins.offline.errors import ReportError
from aniso_plugins.offline.output import watch_commits

EXIT_USAGE = 2
EXIT_ERROR = 1
EXIT_INTERRUPTED = 130


EXAMPLES = """examples:
  aniso report runs/agg/checkpoint-500 --text-file valid.txt --out agg_report
      one checkpoint with a text: report.json, report.md and the plots in ./agg_report
  aniso report runs/mle runs/agg --counts-file train.txt --text-file valid.txt --no-plots
      two models side by side, frequency groups from the training text, no matplotlib needed

docs/report.md describes every input, number and file."""
"""The usage examples under ``aniso --help`` and ``aniso report --help``."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aniso", description="Measure the embedding anisotropy of language models.",
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"aniso {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    r = sub.add_parser(
        "report",
        help="geometry report of one or several models (JSON, Markdown, PNG plots)",
        description="Geometry report of one or several models, side by side: report.json, report.md and PNG plots.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("models", nargs="+", metavar="MODEL",
                   help="a local Hugging Face model directory (or checkpoint-N), a safetensors file, a Lightning "
                   ".ckpt, or a torchtitan (DCP) checkpoint folder")
    r.add_argument("--text-file", metavar="FILE", help="UTF-8 text for frequency groups, perplexity, layers, bottleneck")
    r.add_argument("--counts-file", metavar="FILE",
                   help="text (e.g. the training text) whose token counts define the frequency groups; default: --text-file")
    r.add_argument("--out", metavar="DIR", default="aniso_report", help="output directory (default: ./aniso_report)")
    r.add_argument("--max-tokens", metavar="N", type=int, default=100_000, help="tokens of the text used (default 100000)")
    r.add_argument("--postprocess", metavar="LIST", default="",
                   help="comma-separated transforms: centering, whitening, zca, all_but_the_top (abtt), "
                   "rotation, hadamard")
    r.add_argument("--tensor", metavar="NAME", action="append",
                   help="safetensors tensor to report (repeatable); default: the embedding-like 2-D tensors")
    r.add_argument("--embedding", metavar="NAME",
                   help="parameter name of the input embedding in a Lightning .ckpt or a DCP checkpoint")
    r.add_argument("--head", metavar="NAME", help="parameter name of the LM head in a Lightning .ckpt or a DCP checkpoint")
    r.add_argument("--gram-rows", metavar="M", type=int, default=None,
                   help="rows sampled for the Gram-based metrics (default: exact unless 2·V·d² > 2e11 flops)")
    r.add_argument("--trust-checkpoint", action="store_true",
                   help="read checkpoints that are pickles (DeepSpeed ZeRO shards; a Lightning .ckpt holding objects): "
                        "loading one runs any code it holds, so only for checkpoints you trust")
    r.add_argument("--no-plots", action="store_true", help="write report.json and report.md only")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.add_argument("--json", action="store_true", help="also print report.json to stdout")
    s = sub.add_parser(
        "postprocess",
        help="fit a post-processing transform on a model's sentence embeddings and save it",
        description="Fit a transform (e.g. BERT-whitening) on the pooled sentence embeddings of the text file's "
        "non-empty lines and save it: transform.safetensors (aniso_plugins.offline.postprocess.load_transform) "
        "and postprocess.json (geometry before and after). For a causal LM with an untied head, --transform "
        "centering writes the centred head as a new model folder (the probabilities do not change).",
    )
    s.add_argument("model", metavar="MODEL", help="a local Hugging Face model folder with its tokenizer")
    s.add_argument("--text-file", metavar="FILE", help="UTF-8 text, one sentence per line (encoders)")
    s.add_argument("--transform", required=True, help="whitening, zca, all_but_the_top (abtt), centering, rotation, hadamard")
    s.add_argument("--k", type=int, default=None, help="whitening: directions kept; all_but_the_top: directions removed")
    s.add_argument("--pooling", choices=("mean", "cls"), default=None,
                   help="default: the model's sentence-transformers pooling, else mean")
    s.add_argument("--out", metavar="DIR", required=True, help="output folder")
    return p


class _CtrlC:
    """SIGINT while a command runs. It raises KeyboardInterrupt as usual and is also remembered,
    so that no library can turn a Ctrl-C into something else: one that catches it inside an
    import and fails on the retry (numpy's "cannot load module more than once per process")
    still exits 130, and one that lands in a finalizer, where Python prints it and drops it,
    prints nothing (the command then runs on: a second Ctrl-C stops it). Inside `held()` it is
    only remembered, and raised at the block's end; once the command has its exit code (`done`),
    it is only remembered: nothing can turn a finished command into an interrupted one."""

    def __init__(self) -> None:
        self.seen = False
        self._holding = False
        self._done = False

    def _on_sigint(self, signum: int, frame: object) -> None:
        self.seen = True
        if not (self._holding or self._done):
            raise KeyboardInterrupt

    def done(self, code: int = 0) -> int:
        """`code`: the command's exit code is final from here on, a later Ctrl-C is not raised."""
        self._done = True
        return code

    @contextmanager
    def installed(self, then: Any = None) -> Iterator[None]:
        """The handler while the block runs; at its end, `then` (a handler, or ``signal.SIG_IGN``),
        or by default the handler that was there before (an in-process caller's own)."""
        if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
            yield
            return
        previous_hook = sys.unraisablehook

        def on_unraisable(unraisable: Any) -> None:
            if not (self.seen and issubclass(unraisable.exc_type, KeyboardInterrupt)):
                previous_hook(unraisable)

        previous = signal.signal(signal.SIGINT, self._on_sigint)
        sys.unraisablehook = on_unraisable
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous if then is None else then)
            sys.unraisablehook = previous_hook

    @contextmanager
    def held(self) -> Iterator[None]:
        """No KeyboardInterrupt inside the block: one raised while torch's C extension calls
        back into Python aborts the process (SIGABRT, seen twice in about 200 Ctrl-Cs)."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
        if self.seen:
            raise KeyboardInterrupt


def _interrupted(command: str, committed: list) -> int:
    """The exit code of a Ctrl-C: 130, or 0 once the command's output folder has been renamed
    into place (it holds the new, complete output whatever the Ctrl-C stopped after that)."""
    name = f"aniso{' ' + command if command else ''}"
    if committed:
        print(f"{name}: interrupted after {committed[-1]} was written in full; it holds the new output", file=sys.stderr)
        return 0
    print(f"{name}: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


def main(argv: list[str] | None = None) -> int:
    """Parse, then run the subcommand; every failure and a Ctrl-C at any point, torch's import
    included, is one line on stderr (exit 2 bad input, 1 unexpected, 130 interrupted before the
    output was committed, 0 after). No command: the help on stderr, exit 2.

    Without `argv` (``sys.argv[1:]``: the console script ``aniso``, ``python -m
    aniso_plugins.offline.cli``, both ``sys.exit(main())``), the process is the command's own:
    SIGINT is left ignored when main returns, so that a Ctrl-C from then until the interpreter
    has exited (in ``sys.exit``, atexit, teardown) cannot end the process by the signal (exit
    status -2 / 130) after the output was committed: it exits with main's code. With `argv`
    (called in-process), the caller's SIGINT handler is put back."""
    ctrl_c = _CtrlC()
    with ctrl_c.installed(then=signal.SIG_IGN if argv is None else None), watch_commits() as committed:
        words = sys.argv[1:] if argv is None else argv
        command = next((w for w in words if not w.startswith("-")), "")  # for the message before parsing ends
        try:
            parser = _parser()  # a Ctrl-C here too is the one line
            args = parser.parse_args(argv)
            if args.command is None:
                parser.print_help(sys.stderr)
                print("\naniso: error: a command is required (report or postprocess)", file=sys.stderr)
                return ctrl_c.done(EXIT_USAGE)
            command = args.command
            with ctrl_c.held():
                from aniso_plugins.offline.commands import COMMANDS  # torch loads here

            # done inside the try: a Ctrl-C before it is caught below (0 once committed), none after is raised
            return ctrl_c.done(COMMANDS[args.command](args))
        except (KeyboardInterrupt, Exception) as e:
            ctrl_c.done()  # the exit code is decided below; a Ctrl-C from here on does not interrupt that
            if isinstance(e, KeyboardInterrupt) or ctrl_c.seen:
                return _interrupted(command, committed)
            if isinstance(e, ReportError):
                print(f"aniso {command}: error: {e}", file=sys.stderr)
                return EXIT_USAGE
            if os.environ.get("ANISO_DEBUG"):  # anything unexpected: one line, no traceback unless asked
                raise
            text = str(e).strip().splitlines()
            print(f"aniso {command}: error: {type(e).__name__}: {text[0] if text else ''}", file=sys.stderr)
            return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
