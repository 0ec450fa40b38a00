"""`aniso report`: the geometry of a model's embeddings as one JSON file, one Markdown table and
a few plots (docs/report.md). This module is the public entry (`analyze` with its `TextOptions`
and `MatrixOptions`, `write_report`, `Report`, `ReportError`); the work is done by

- `aniso_plugins.offline.sources`: the inputs (`load_model`, `MatrixSource`): a local Hugging
  Face model directory (causal LM, masked LM, encoder-decoder or bare encoder; loaded offline),
  a safetensors file (its embedding-like 2-D tensors, or ``MatrixOptions(tensor=NAME)``), or an in-memory
  ``nn.Module`` / 2-D tensor (`write_report`), read in row blocks;
- `aniso_plugins.offline.analysis`: the geometry of each matrix (`matrix_geometry`): the two
  rounds of the training plugin (`aniso_plugins.metrics.geometry.rounds`) summed over row
  blocks exactly as `aniso_plugins.numerics.reduce` sums them over ranks, with a row sample for
  the Gram of large matrices;
- `aniso_plugins.offline.text_pass`: with a text, the built-in metric plugins (``frequency``,
  ``eval``, ``hidden``, ``bottleneck``) driven through `AnisoPlugins` as an adapter drives them
  over one evaluation pass;
- `aniso_plugins.offline.render`: the Markdown tables and the plots.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aniso_plugins.core.errors import ConfigError
from aniso_plugins.metrics.geometry.stats import BLOCK_ROWS
from aniso_plugins.offline.analysis import (
    GRAM_FLOPS,
    HIST_BINS,
    HIST_ROWS,
    matrix_geometry,
    source_geometry,
)
from aniso_plugins.offline.errors import ReportError, one_line
from aniso_plugins.offline.text_file import read_text
from aniso_plugins.offline.output import UNDER_TRAINED_CSV, atomic_directory
from aniso_plugins.offline.postprocess import make_transform
from aniso_plugins.offline.render import (
    PROJECTION_POINTS,
    render_markdown,
    render_plots,
    require_matplotlib,
)
from aniso_plugins.offline.sentences import sentence_entry
from aniso_plugins.offline.sources import LoadedModel, MatrixSource, load_model
from aniso_plugins.offline.under_trained import find_under_trained, write_suspects_csv
from aniso_plugins.offline.text_pass import (
    sequence_length,
    text_blocks,
    text_pass,
    tokens,
)

FORMAT_VERSION = 1
logger = logging.getLogger(__name__)
SENTENCE_KINDS = ("encoder", "masked-lm")
"""Model kinds whose pooled sentence embeddings of the text are measured (`sentence_entry`)."""


# --- the report -----------------------------------------------------------------------------
def _public(obj):
    """`obj` without the keys starting with ``_`` (per-token tensors), NaN and inf as None."""
    if isinstance(obj, dict):
        return {k: _public(v) for k, v in obj.items() if not k.startswith("_")}
    if isinstance(obj, list):
        return [_public(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


@dataclass
class Report:
    """The result of `analyze`: ``models`` is a list of dicts (one per MODEL), each with
    ``matrices`` (name -> geometry) and, with a text, ``text``."""

    models: list[dict[str, Any]]
    settings: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return _public({"format_version": FORMAT_VERSION, "settings": self.settings, "models": self.models})

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def to_markdown(self, plots: Sequence[str] = ()) -> str:
        """report.md; `plots`: the pictures beside it, shown with their titles and axes."""
        return render_markdown(self, plots)

    def plot(self, directory: str | os.PathLike) -> list[str]:
        """Write the PNG plots into `directory`; returns their paths."""
        return render_plots(self, Path(directory))

    def write(self, directory: str | os.PathLike, plots: bool = True) -> list[str]:
        """report.json, report.md, under_trained.csv (every suspected under-trained token, when
        a model has reference tokens) and (with `plots`) the PNGs, shown in report.md, into
        `directory`, atomically (`atomic_directory`: an earlier report there is replaced whole,
        an interrupted write leaves none); returns the paths."""
        if plots:
            require_matplotlib()
        with atomic_directory(directory) as tmp:
            pictures = [Path(p).name for p in self.plot(tmp)] if plots else []
            (tmp / "report.json").write_text(self.to_json() + "\n")
            (tmp / "report.md").write_text(self.to_markdown(pictures))
            names = ["report.json", "report.md"]
            if write_suspects_csv(self.models, tmp / UNDER_TRAINED_CSV):
                names.append(UNDER_TRAINED_CSV)
        return [str(Path(directory) / n) for n in [*names, *pictures]]


def _progress_factory(enabled: bool):
    """A tqdm bar ``bar(iterable, total, desc)`` on stderr, or None (disabled, no tqdm)."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None

    def bar(it, total, desc):
        return tqdm(it, total=total, desc=desc, leave=False, dynamic_ncols=True, mininterval=0.5)

    return bar


# --- analyze ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TextOptions:
    """The text `analyze` runs through each model, and how (the default: no text, matrices only)."""

    text_file: str | os.PathLike | None = None
    """A UTF-8 corpus for the frequency groups, per-group perplexity and Uniq, the per-layer
    hidden-state anisotropy, the bottleneck probe and an encoder's sentence embeddings."""
    text: str | None = None
    """The corpus as a string, instead of `text_file`."""
    tokenizer: Any = None
    """The tokenizer of models without their own (in-memory models); a model folder's is used otherwise."""
    max_tokens: int = 100_000
    """Tokens of the text used, at most."""
    batch_size: int = 8
    """Sequences per batch of the text pass."""
    hidden_samples: int = 1000
    """Token occurrences sampled per block for the hidden-state anisotropy."""
    counts_file: str | os.PathLike | None = None
    """A text (e.g. the training text) whose token counts define the rare / medium / frequent
    groups instead of the text's own; needs a text."""
    max_count_tokens: int = 10_000_000
    """Tokens of `counts_file` counted, at most."""


@dataclass(frozen=True)
class MatrixOptions:
    """Which matrices `analyze` reads, and how their Gram-based metrics are computed."""

    tensor: str | Sequence[str] | None = None
    """The safetensors tensor name(s) to read (default: the embedding-like 2-D tensors)."""
    embedding: str | None = None
    """The input embedding's parameter name in a Lightning ``.ckpt`` or a DCP checkpoint (found by name otherwise)."""
    head: str | None = None
    """The LM head's parameter name in a Lightning ``.ckpt`` or a DCP checkpoint (found by name otherwise)."""
    gram_rows: int | None = None
    """Rows sampled for the Gram-based metrics (None: exact unless the Gram costs more than `gram_flops`)."""
    gram_flops: float = GRAM_FLOPS
    """The flops of one exact Gram pass above which its rows are sampled."""


def check_counts(*, max_tokens: int, gram_rows: int | None) -> None:
    """`ReportError` for ``max_tokens`` < 2 or ``gram_rows`` < 2 (None means: exact unless large)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 2:
        raise ReportError(f"--max-tokens {max_tokens}: need an integer >= 2")
    if gram_rows is not None and (isinstance(gram_rows, bool) or not isinstance(gram_rows, int) or gram_rows < 2):
        raise ReportError(f"--gram-rows {gram_rows}: need an integer >= 2 (leave it out for the exact Gram)")


def _check_options(text: Any, matrices: Any) -> None:
    """`TypeError` for an option group that is not its dataclass (e.g. a path where the
    `TextOptions` go, as `analyze`'s second argument was the text file)."""
    for value, cls, name, example in ((text, TextOptions, "text", "text_file=..."),
                                      (matrices, MatrixOptions, "matrices", "tensor=...")):
        if not isinstance(value, cls):
            raise TypeError(f"analyze({name}={value!r}): expected a {cls.__name__}, e.g. {name}={cls.__name__}({example})")


def _texts(text: TextOptions) -> tuple[str | None, str | None]:
    """The evaluated text (`text_file` or `text`) and the counts text (`counts_file`)."""
    corpus = read_text(text.text_file, "text file") if text.text_file is not None else text.text
    count_text = None
    if text.counts_file is not None:
        if corpus is None:
            raise ReportError("--counts-file needs --text-file (the groups are used for the text's metrics)")
        count_text = read_text(text.counts_file, "counts file")
    return corpus, count_text


def _transforms(postprocess: Sequence[str | Any]) -> list[tuple[str, Any]]:
    """(name, transform) of each post-processing: a name (`make_transform`) or a transform object
    (named by its class)."""
    named = [(p if isinstance(p, str) else type(p).__name__, p) for p in postprocess]
    try:
        return [(n, make_transform(p) if isinstance(p, str) else p) for n, p in named]
    except ConfigError as e:
        raise ReportError(str(e)) from None


def _unique_names(loaded: list[LoadedModel]) -> None:
    """Number repeated column names: ``gpt2``, ``gpt2 (2)``, …"""
    seen: dict[str, int] = {}
    for lm in loaded:
        if lm.name in seen:
            seen[lm.name] += 1
            lm.name = f"{lm.name} ({seen[lm.name]})"
        else:
            seen[lm.name] = 1


def _check_text_source(lm: LoadedModel, text: str | None, tokenizer: Any) -> None:
    """Give `lm` the caller's `tokenizer` where it has none; refuse a text for a trainer
    checkpoint (no model to run it through)."""
    if text is not None and lm.model is None and lm.kind in ("lightning", "dcp"):
        raise ReportError(f"--text-file needs a Hugging Face model folder; {lm.path} is a {lm.kind} checkpoint "
                          "(its matrices are reported without a text)")
    if tokenizer is not None and lm.tokenizer is None:
        lm.tokenizer = tokenizer


def _model_entry(lm: LoadedModel, corpus: str | None, count_text: str | None, transforms, text: TextOptions,
                 matrices: MatrixOptions, bar) -> dict[str, Any]:
    """One model's part of the report: every matrix's geometry and, with a text (`corpus`), the
    text pass and an encoder's sentence embeddings."""
    def geometry(source: MatrixSource) -> dict[str, Any]:
        return source_geometry(source, transforms, gram_rows=matrices.gram_rows, gram_flops=matrices.gram_flops,
                               progress=bar, block_rows=BLOCK_ROWS)

    entry: dict[str, Any] = {"name": lm.name, "path": lm.path, "kind": lm.kind, "tied": lm.tied,
                             "notes": list(lm.notes), "_warnings": list(lm.warnings), "matrices": {}}
    for warning in lm.warnings:  # the CLI shows them as "aniso report: warning: ..." lines
        logger.warning("%s: %s", lm.name, warning)
    ids = tokens(lm, corpus, text.max_tokens) if corpus is not None else None
    count_ids = tokens(lm, count_text, text.max_count_tokens) if count_text is not None else None
    for key, source in lm.matrices.items():
        entry["matrices"][key] = geometry(source)
    if ids is not None:
        entry["text"] = text_pass(lm, ids, batch_size=text.batch_size, hidden_samples=text.hidden_samples, progress=bar,
                                  count_ids=count_ids)
    if corpus is not None and lm.kind in SENTENCE_KINDS:
        entry["sentences"] = sentence_entry(lm, corpus, geometry)
    if {"embedding", "head"} & set(lm.matrices):
        vocab = next(iter(lm.matrices.values())).shape[0]
        counts = None if count_ids is None else torch.bincount(count_ids.reshape(-1), minlength=vocab)
        try:  # an auxiliary section: a tokenizer or model it cannot handle leaves the rest of the report
            norms = entry["matrices"].get("embedding", {}).get("_norms")  # from the geometry pass
            entry["under_trained"] = find_under_trained(lm, counts, norms)
        except Exception as e:
            entry["under_trained"] = {"error": one_line(e)}
    return entry


def analyze(
    models: Sequence[str | os.PathLike | nn.Module | torch.Tensor] | str | os.PathLike | nn.Module,
    text: TextOptions = TextOptions(),
    matrices: MatrixOptions = MatrixOptions(),
    postprocess: Sequence[str | Any] = (),
    *,
    names: Sequence[str] | None = None,
    progress: bool = True,
    trust_checkpoint: bool = False,
) -> Report:
    """Analyse one or several models (paths, modules or tensors) into one side-by-side `Report`.

    text: the corpus run through each model (`TextOptions`; none by default). matrices: which
    matrices are read and how their Gram is computed (`MatrixOptions`). postprocess: names
    ("centering", "whitening", "zca", "all_but_the_top", "rotation", "hadamard") or transform
    objects with ``fit``/``transform``. names: the models' column names (default: from their
    paths). progress: a tqdm bar on stderr. trust_checkpoint: read checkpoints that only unpickle
    with ``weights_only=False`` (DeepSpeed ZeRO shards), which runs any code they hold; they are
    refused without it. Raises `ReportError` on bad input."""
    _check_options(text, matrices)
    if isinstance(models, (str, os.PathLike, nn.Module, torch.Tensor)):
        models = [models]
    if not models:
        raise ReportError("no MODEL given")
    tensor = matrices.tensor
    tensors = [tensor] if isinstance(tensor, str) else (list(tensor) if tensor else None)
    corpus, count_text = _texts(text)
    check_counts(max_tokens=text.max_tokens, gram_rows=matrices.gram_rows)
    bar = _progress_factory(progress)
    transforms = _transforms(postprocess)
    loaded = [
        load_model(m, tensor=tensors, need_model=corpus is not None, name=(names[i] if names and i < len(names) else None),
                   embedding=matrices.embedding, head=matrices.head, trust_checkpoint=trust_checkpoint)
        for i, m in enumerate(models)
    ]
    _unique_names(loaded)
    out = []
    for lm in loaded:
        _check_text_source(lm, corpus, text.tokenizer)
        out.append(_model_entry(lm, corpus, count_text, transforms, text, matrices, bar))
    settings = {
        "text_file": None if text.text_file is None else str(text.text_file),
        "counts_file": None if text.counts_file is None else str(text.counts_file),
        "max_tokens": text.max_tokens, "postprocess": [n for n, _ in transforms], "tensor": tensors,
        "gram_flops": matrices.gram_flops, "gram_rows": matrices.gram_rows,
    }
    return Report(out, settings)


def write_report(
    model: nn.Module | str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    text: str | None = None,
    tokenizer: Any = None,
    text_file: str | os.PathLike | None = None,
    postprocess: Sequence[str | Any] = (),
    max_tokens: int = 100_000,
    plots: bool = True,
    progress: bool = False,
    name: str | None = None,
    trust_checkpoint: bool = False,
) -> list[str]:
    """Write the report of one model (e.g. an in-memory model at the end of training) into
    `out_dir`: report.json, report.md and the PNGs (needs matplotlib; without it, only the
    JSON and Markdown). `text` + `tokenizer` (or the model dir's tokenizer with `text_file`)
    add the text-based parts. Returns the written paths. The model's mode and weights are left
    as they were. trust_checkpoint: as in `analyze`."""
    options = TextOptions(text_file=text_file, text=text, tokenizer=tokenizer, max_tokens=max_tokens)
    report = analyze([model], options, postprocess=postprocess, progress=progress, names=[name] if name else None,
                     trust_checkpoint=trust_checkpoint)
    if plots:
        try:
            require_matplotlib()
        except ReportError:
            plots = False
    return report.write(out_dir, plots=plots)


__all__ = [
    "FORMAT_VERSION",
    "GRAM_FLOPS",
    "HIST_BINS",
    "HIST_ROWS",
    "PROJECTION_POINTS",
    "LoadedModel",
    "MatrixOptions",
    "MatrixSource",
    "Report",
    "ReportError",
    "TextOptions",
    "analyze",
    "load_model",
    "matrix_geometry",
    "render_markdown",
    "render_plots",
    "sequence_length",
    "text_blocks",
    "text_pass",
    "write_report",
]
