"""`aniso report`: the geometry of a model's embeddings as one JSON file, one Markdown table and
a few plots (docs/report.md).

Everything is computed with the package's own functions: `aniso_plugins.metrics.geometry.stats` (the
reducible statistics, summed over row blocks exactly as `aniso_plugins.numerics.reduce` sums them over
ranks, and their finish functions), `aniso_plugins.metrics.geometry.isoscore`, and, with a text, the built-in
metric plugins (``frequency``, ``eval``, ``hidden``, ``bottleneck``) driven through
`AnisoPlugins` as an adapter drives them over one evaluation pass.

Inputs (`analyze(models=...)`): a local Hugging Face model directory (causal LM, masked LM or
bare encoder; loaded offline), a safetensors file (its embedding-like 2-D tensors, or
``tensor=NAME``), or an in-memory ``nn.Module`` / 2-D tensor (`write_report`).

Large matrices: the rows are streamed in blocks (``safe_open(...).get_slice(name)[a:b]``). When
2·V·d² exceeds ``gram_flops`` the d×d Gram (spectrum, effective rank, IsoScore, variance shares)
and the partition functions of I(W) are computed from ``gram_rows`` uniformly sampled rows (the
Gram scaled by V/m, log Z shifted by log(V/m)), in float32 blocks accumulated in float64;
the mean cosines (raw and centred), norms and the 2-D projection stay exact over all V rows.
The report says which (``"gram": "exact"`` or ``"sampled (m rows)"``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aniso_plugins.core.errors import AnisoError
from aniso_plugins.core.model import ModelHandle, OutputEmbeddingsHandle
from aniso_plugins.metrics.frequency.groups import GROUPS, frequency_groups
from aniso_plugins.metrics.geometry.isoscore import isoscore_from_variances
from aniso_plugins.metrics.geometry.stats import (
    BLOCK_ROWS,
    Spectrum,
    isotropy_finish,
    isotropy_stats,
    mean_cosine_finish,
    mean_cosine_stats,
    mean_row,
    mean_stats,
    moment_stats,
    moments,
)
from aniso_plugins.numerics.reduce import Stat

FORMAT_VERSION = 1
GRAM_FLOPS = 2.0e11
"""Above 2·V·d² flops (one exact Gram pass) the Gram-based metrics use a row sample."""
HIST_ROWS = 2000
"""Rows sampled for the histogram of pairwise cosines."""
HIST_BINS = 100
PROJECTION_POINTS = 20000
"""Points drawn in the 2-D projection plot (all rows are projected; at most this many drawn)."""
_EMBEDDING_NAME = re.compile(r"(embed|wte|word_embeddings|lm_head|tok_embeddings|(^|\.)output\.weight$|decoder\.weight$)")


class ReportError(AnisoError):
    """A bad input (missing file, no weights, corrupt file, no embeddings, text without a
    tokenizer): the CLI prints it as one line and exits non-zero."""


# --- row sources ---------------------------------------------------------------------------
@dataclass
class MatrixSource:
    """A (V, d) matrix read in row blocks: ``blocks()`` yields (offset, rows) with rows in the
    stored dtype."""

    name: str
    shape: tuple[int, int]
    dtype: str
    read: Callable[[int, int], torch.Tensor]

    def blocks(self, block_rows: int = BLOCK_ROWS) -> Iterator[tuple[int, torch.Tensor]]:
        for a in range(0, self.shape[0], block_rows):
            yield a, self.read(a, min(a + block_rows, self.shape[0]))

    @classmethod
    def of_tensor(cls, name: str, weight: torch.Tensor) -> MatrixSource:
        w = weight.detach()
        if w.dim() != 2 or not w.is_floating_point():
            raise ReportError(f"{name}: expected a 2-D floating-point tensor, got {tuple(w.shape)} {w.dtype}")
        return cls(name, (int(w.shape[0]), int(w.shape[1])), str(w.dtype).replace("torch.", ""), lambda a, b: w[a:b])


def _safetensors_sources(path: Path, names: Sequence[str] | None) -> list[MatrixSource]:
    from safetensors import safe_open

    try:
        f = safe_open(str(path), framework="pt")
        keys = list(f.keys())
    except Exception as e:  # SafetensorError, OSError, header errors
        raise ReportError(f"cannot read safetensors file {path}: {_one_line(e)}") from None

    def shape(key: str) -> list[int]:
        return list(f.get_slice(key).get_shape())

    two_d = [k for k in keys if len(shape(k)) == 2 and f.get_slice(k).get_dtype().startswith(("F", "BF"))]
    if names:
        missing = [n for n in names if n not in keys]
        if missing:
            raise ReportError(f"{path} has no tensor {missing[0]!r} (2-D tensors: {', '.join(two_d[:12]) or 'none'})")
        bad = [n for n in names if n not in two_d]
        if bad:
            raise ReportError(f"tensor {bad[0]!r} in {path} is not a 2-D floating-point tensor {shape(bad[0])}")
        chosen = list(names)
    else:
        chosen = [k for k in two_d if _EMBEDDING_NAME.search(k)]
        if not chosen:
            raise ReportError(
                f"{path} has no embedding-like 2-D tensor (2-D tensors: {', '.join(two_d[:12]) or 'none'}); "
                "name one with --tensor NAME"
            )
    out = []
    for key in chosen:
        sl = f.get_slice(key)
        v, d = shape(key)
        dtype = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(sl.get_dtype(), sl.get_dtype())
        out.append(MatrixSource(key, (v, d), dtype, lambda a, b, sl=sl, f=f: sl[a:b]))
    return out


# --- geometry of one matrix ----------------------------------------------------------------
def _combine(acc: dict[str, Stat], part: dict[str, Stat]) -> None:
    """Sum (or log-sum-exp) `part` into `acc`, as `reduce_stats` combines ranks."""
    for k, s in part.items():
        if k not in acc:
            acc[k] = Stat(s.value.clone(), s.op)
        elif s.op == "sum":
            acc[k] = Stat(acc[k].value + s.value, "sum")
        elif s.op == "lse":
            acc[k] = Stat(torch.logaddexp(acc[k].value, s.value), "lse")
        elif s.op == "max":
            acc[k] = Stat(torch.maximum(acc[k].value, s.value), "max")
        else:
            acc[k] = Stat(torch.minimum(acc[k].value, s.value), "min")


def _values(acc: dict[str, Stat]) -> dict[str, torch.Tensor]:
    return {k: s.value for k, s in acc.items()}


def _gram_f32(rows: torch.Tensor) -> torch.Tensor:
    x = rows.to(torch.float32)
    return (x.T @ x).to(torch.float64)


def _spectrum_metrics(spec: Spectrum) -> dict[str, float]:
    return {**spec.summary(), "w_error_half_rank": spec.w_error(spec.size // 2)}


def _histogram(x: torch.Tensor, mean: torch.Tensor | None) -> dict[str, list[float]]:
    x = x.to(torch.float64)
    if mean is not None:
        x = x - mean
    norm = x.norm(dim=1)
    x = x[norm > 0] / norm[norm > 0, None]
    cos = x @ x.T
    i, j = torch.triu_indices(len(x), len(x), 1)
    c = cos[i, j].clamp(-1, 1)
    counts = torch.histc(c, bins=HIST_BINS, min=-1.0, max=1.0)
    return {"counts": [int(v) for v in counts.tolist()], "min": -1.0, "max": 1.0, "pairs": int(c.numel())}


def _outliers(samples: torch.Tensor) -> dict[str, float] | None:
    """`aniso_plugins.offline.postprocess.outlier_stats` of the sampled rows (None if unavailable)."""
    try:
        from aniso_plugins.offline.postprocess import outlier_stats
    except ImportError:
        return None
    return outlier_stats(samples)


def matrix_geometry(
    source: MatrixSource,
    *,
    transform: Any = None,
    gram_rows: int | None = None,
    gram_flops: float = GRAM_FLOPS,
    seed: int = 0,
    progress: Callable[[Iterable, int, str], Iterable] | None = None,
    keep_rows: bool = True,
) -> dict[str, Any]:
    """Every geometry metric of one matrix, raw and centred, in two streamed passes (the
    two-round pattern of `aniso_plugins.metrics.geometry.plugin`). `transform`: an object with
    ``.transform(rows)`` applied to every block first (post-processing). Returns a dict of
    JSON-able numbers, plus ``_norms``/``_projection`` tensors (dropped from the JSON)."""
    v, d = source.shape
    n_blocks = math.ceil(v / BLOCK_ROWS)
    bar = progress if progress is not None and n_blocks >= 4 else (lambda it, total, desc: it)
    exact = gram_rows is None and 2.0 * v * d * d <= gram_flops
    m = v if exact else min(v, gram_rows or max(4 * d, int(gram_flops / (2.0 * d * d))))
    exact = exact or m >= v
    g = torch.Generator().manual_seed(seed)
    gram_pick = None if exact else torch.randperm(v, generator=g)[:m].sort().values
    hist_pick = torch.randperm(v, generator=g)[: min(HIST_ROWS, v)].sort().values

    def rows_of(block: torch.Tensor) -> torch.Tensor:
        if transform is None:
            return block
        return transform.transform(block if block.dtype in (torch.float32, torch.float64) else block.float())

    def picked(pick: torch.Tensor, a: int, x: torch.Tensor) -> torch.Tensor:
        sel = pick[(pick >= a) & (pick < a + len(x))] - a
        return x[sel]

    # pass 1 (round 0): Gram (or its sample), row sum, count, raw unit-row sum, norms, non-finite
    acc: dict[str, Stat] = {}
    norms, gram_sample, hist_rows = [], [], []
    for a, block in bar(source.blocks(), n_blocks, f"{source.name}: pass 1/2"):
        x = rows_of(block)
        if exact:
            _combine(acc, moment_stats(x))
        else:
            _combine(acc, mean_stats(x))
            s = picked(gram_pick, a, x)
            gram_sample.append(s.to(torch.float32))
            _combine(acc, {"gram": Stat(_gram_f32(s))})
        _combine(acc, mean_cosine_stats(x, "raw/"))
        _combine(acc, {"nonfinite": Stat((~torch.isfinite(x)).sum().to(torch.float64))})
        norms.append(x.to(torch.float64).norm(dim=1).to(torch.float32))
        hist_rows.append(picked(hist_pick, a, x).to(torch.float32))
    r0 = _values(acc)
    if not exact:  # the sampled Gram, scaled to V rows
        r0["gram"] = r0["gram"] * (v / m)
    stats = moments(r0)
    raw, centered = Spectrum.from_moments(stats, center=False), Spectrum.from_moments(stats, center=True)
    mu = mean_row(r0)

    # pass 2 (round 1): partition functions of I(W) along the eigenvectors, centred unit-row sum,
    # the 2-D projection on the top two raw singular directions
    acc1: dict[str, Stat] = {}
    top2 = raw.eigenvectors[:, :2].to(torch.float32)
    projection = []
    if not exact:
        sample = torch.cat(gram_sample)
        shift = math.log(v / m)
        for s in sample.split(BLOCK_ROWS):
            for key, vecs, mean in (("raw/", raw.eigenvectors, None), ("centered/", centered.eigenvectors, mu)):
                z = (s @ vecs.to(torch.float32)).to(torch.float64)
                log_z = torch.logsumexp(z, dim=0)
                if mean is not None:
                    log_z = log_z - mean @ vecs
                _combine(acc1, {key + "log_z": Stat(log_z, "lse")})
        for key in ("raw/", "centered/"):
            acc1[key + "log_z"] = Stat(acc1[key + "log_z"].value + shift, "lse")
    for a, block in bar(source.blocks(), n_blocks, f"{source.name}: pass 2/2"):
        x = rows_of(block)
        if exact:
            _combine(acc1, isotropy_stats(x, raw.eigenvectors, "raw/"))
            _combine(acc1, isotropy_stats(x, centered.eigenvectors, "centered/", mean=mu))
        _combine(acc1, mean_cosine_stats(x, "centered/", mean=mu))
        if keep_rows:
            projection.append(x.to(torch.float32) @ top2)
    r1 = _values(acc1)
    samples = torch.cat(hist_rows)
    out: dict[str, Any] = {
        "rows": v,
        "dim": d,
        "dtype": source.dtype,
        "gram": "exact" if exact else f"sampled ({m} rows, float32 blocks)",
        "nonfinite": int(r0["nonfinite"]),
        "isoscore": isoscore_from_variances(centered.eigenvalues),
        "norm_mean": float(torch.cat(norms).double().mean()),
        "raw": {
            "mean_cosine": mean_cosine_finish(r0, "raw/"),
            "isotropy": isotropy_finish(r1, "raw/"),
            **_spectrum_metrics(raw),
        },
        "centered": {
            "mean_cosine": mean_cosine_finish(r1, "centered/"),
            "isotropy": isotropy_finish(r1, "centered/"),
            **_spectrum_metrics(centered),
        },
        "spectrum": [float(x) for x in raw.normalized().tolist()],
        "spectrum_centered": [float(x) for x in centered.normalized().tolist()],
        "outliers_sampled": _outliers(samples),
        "cosine_histogram": _histogram(samples, None),
        "cosine_histogram_centered": _histogram(samples, mu),
    }
    if keep_rows:
        out["_norms"] = torch.cat(norms).cpu()
        out["_projection"] = torch.cat(projection).cpu()
    return out


# --- post-processing -------------------------------------------------------------------------
def _make_transform(name: str):
    try:
        from aniso_plugins.offline import postprocess
    except ImportError as e:
        raise ReportError(f"--postprocess needs aniso_plugins.offline.postprocess: {_one_line(e)}") from None
    key = name.strip().lower().replace("-", "_")
    table = {
        "centering": lambda: postprocess.Centering(),
        "whitening": lambda: postprocess.Whitening(),
        "zca": lambda: postprocess.Whitening(zca=True),
        "all_but_the_top": lambda: postprocess.AllButTheTop(),
        "abtt": lambda: postprocess.AllButTheTop(),
        "rotation": lambda: postprocess.Rotation(),
        "hadamard": lambda: postprocess.Rotation(kind="hadamard"),
    }
    if key not in table:
        raise ReportError(f"unknown post-processing {name!r}: expected one of {', '.join(sorted(table))}")
    return table[key]()


def _fit(transform, source: MatrixSource):
    """Fit `transform` on all rows of `source`, streamed block by block (float32 or float64)."""
    def blocks():
        for _, b in source.blocks():
            yield b if b.dtype in (torch.float32, torch.float64) else b.float()

    try:
        return transform.fit(blocks(), distributed=False)
    except TypeError:  # a transform object without the `distributed` keyword
        return transform.fit(blocks())


# --- models ---------------------------------------------------------------------------------
@dataclass
class LoadedModel:
    name: str
    path: str
    kind: str  # "causal-lm", "masked-lm", "seq2seq-lm", "encoder", "safetensors", "module", "tensor"
    matrices: dict[str, MatrixSource]
    tied: bool | None = None
    model: nn.Module | None = None
    tokenizer: Any = None
    notes: list[str] = field(default_factory=list)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    with contextlib.suppress(Exception):
        transformers.utils.logging.disable_progress_bar()
    return transformers


def _model_kind(config) -> str:
    archs = " ".join(getattr(config, "architectures", None) or [])
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq-lm"
    if "CausalLM" in archs or "LMHeadModel" in archs:
        return "causal-lm"
    if "MaskedLM" in archs:
        return "masked-lm"
    return "encoder"


def _modules_from(model: nn.Module) -> tuple[dict[str, MatrixSource], bool | None]:
    get_in = getattr(model, "get_input_embeddings", None)
    try:
        emb = get_in() if callable(get_in) else None
    except (AttributeError, NotImplementedError):
        emb = None
    get_out = getattr(model, "get_output_embeddings", None)
    try:
        head = get_out() if callable(get_out) else None
    except (AttributeError, NotImplementedError):
        head = None
    ew = getattr(emb, "weight", None) if emb is not None else None
    hw = getattr(head, "weight", None) if head is not None else None
    matrices: dict[str, MatrixSource] = {}
    if isinstance(ew, torch.Tensor) and ew.dim() == 2:
        matrices["embedding"] = MatrixSource.of_tensor("embedding", ew)
    tied = None
    if isinstance(hw, torch.Tensor) and hw.dim() == 2:
        tied = isinstance(ew, torch.Tensor) and (hw is ew or hw.data_ptr() == ew.data_ptr())
        if not tied:
            matrices["head"] = MatrixSource.of_tensor("head", hw)
    return matrices, tied


def _hf_stream_sources(path: Path, config, auto) -> tuple[dict[str, MatrixSource], bool | None] | None:
    """The embedding (and untied head) of an HF model directory as streamed safetensors
    tensors, without loading the model: the parameter names come from the model built on the
    meta device. None when that does not work (no safetensors, renamed keys): load it then."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except Exception:
            return None
    elif (path / "model.safetensors").exists():
        from safetensors import safe_open

        try:
            with safe_open(str(path / "model.safetensors"), framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), "model.safetensors")
        except Exception as e:
            raise ReportError(f"cannot read safetensors file {path / 'model.safetensors'}: {_one_line(e)}") from None
    else:
        return None
    try:
        with torch.device("meta"):
            model = auto.from_config(config)
        emb = model.get_input_embeddings()
        head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    except Exception:
        return None
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    wanted = {}
    ew = getattr(emb, "weight", None)
    hw = getattr(head, "weight", None) if head is not None else None
    if isinstance(ew, torch.Tensor) and ew.dim() == 2:
        wanted["embedding"] = ew
    tied = None
    if isinstance(hw, torch.Tensor) and hw.dim() == 2:
        tied = hw is ew
        if not tied:
            wanted["head"] = hw
    if not wanted:
        return None
    matrices = {}
    for key, param in wanted.items():
        found = [n for n in names.get(id(param), []) if n in weight_map]
        if not found:
            return None
        (source,) = _safetensors_sources(path / weight_map[found[0]], [found[0]])
        if source.shape != tuple(param.shape):
            return None
        source.name = key
        matrices[key] = source
    return matrices, tied


def load_model(spec: str | os.PathLike | nn.Module | torch.Tensor, *, tensor: Sequence[str] | None = None,
               need_model: bool = False, name: str | None = None) -> LoadedModel:
    """Resolve one MODEL argument (see the module docstring). Raises `ReportError`."""
    if isinstance(spec, torch.Tensor):
        return LoadedModel(name or "tensor", "<tensor>", "tensor", {"matrix": MatrixSource.of_tensor("matrix", spec)})
    if isinstance(spec, nn.Module):
        matrices, tied = _modules_from(spec)
        if not matrices:
            raise ReportError(f"{type(spec).__name__} has no input or output embedding (get_input_embeddings())")
        cfg = getattr(spec, "config", None)
        kind = _model_kind(cfg) if cfg is not None else ("causal-lm" if "head" in matrices or tied else "module")
        return LoadedModel(name or type(spec).__name__, "<in memory>", kind, matrices, tied, spec)
    path = Path(spec)
    label = name or (path.name if path.name else str(path))
    if path.parent.name and path.name.startswith("checkpoint-"):
        label = name or f"{path.parent.name}/{path.name}"
    if not path.exists():
        raise ReportError(f"no such file or directory: {path}")
    if path.is_file():
        if path.suffix != ".safetensors":
            with open(path, "rb") as f:
                head = f.read(8)
            if len(head) < 8:
                raise ReportError(f"cannot read safetensors file {path}: file too short")
        return LoadedModel(label, str(path), "safetensors", {s.name: s for s in _safetensors_sources(path, tensor)})
    if not (path / "config.json").exists():
        files = sorted(path.glob("*.safetensors"))
        if files:
            sources = [s for f in files for s in _safetensors_sources(f, tensor)]
            return LoadedModel(label, str(path), "safetensors", {s.name: s for s in sources})
        raise ReportError(f"{path} is not a model directory: no config.json and no *.safetensors weights")
    if not any((path / f).exists() for f in _WEIGHT_FILES) and not list(path.glob("*.safetensors")):
        raise ReportError(f"{path} has a config.json but no weights (model.safetensors or pytorch_model.bin)")
    if tensor:
        files = sorted(path.glob("*.safetensors"))
        sources = []
        for f in files:
            with contextlib.suppress(ReportError):
                sources += _safetensors_sources(f, [t for t in tensor])
        if not sources:
            raise ReportError(f"no tensor {tensor[0]!r} in the safetensors files of {path}")
        return LoadedModel(label, str(path), "safetensors", {s.name: s for s in sources})
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        transformers = _quiet_transformers()
    except ImportError:
        raise ReportError("a Hugging Face model directory needs transformers (pip install aniso-plugins[hf])") from None
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise ReportError(f"cannot read the config of {path}: {_one_line(e)}") from None
    kind = _model_kind(config)
    auto = {
        "causal-lm": transformers.AutoModelForCausalLM,
        "masked-lm": transformers.AutoModelForMaskedLM,
        "seq2seq-lm": transformers.AutoModelForSeq2SeqLM,
    }.get(kind, transformers.AutoModel)
    tokenizer = None
    if any((path / f).exists() for f in _TOKENIZER_FILES):  # else AutoTokenizer may build an empty one
        with contextlib.suppress(Exception):
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if not need_model:
        streamed = _hf_stream_sources(path, config, auto)
        if streamed is not None:
            matrices, tied = streamed
            return LoadedModel(label, str(path), kind, matrices, tied, None, tokenizer)
    try:
        model = auto.from_pretrained(str(path), local_files_only=True, dtype="auto")
    except Exception as e:
        raise ReportError(f"cannot load the model in {path}: {_one_line(e)}") from None
    model.eval()
    matrices, tied = _modules_from(model)
    if not matrices:
        raise ReportError(f"the model in {path} ({type(model).__name__}) has no input or output embedding")
    return LoadedModel(label, str(path), kind, matrices, tied, model, tokenizer)


# --- the text pass -------------------------------------------------------------------------
def _tokens(loaded: LoadedModel, text: str, max_tokens: int) -> torch.Tensor:
    tok = loaded.tokenizer
    if tok is None:
        where = "a safetensors file" if loaded.kind == "safetensors" else "a directory without tokenizer files"
        raise ReportError(f"--text-file needs a tokenizer, but {loaded.path} is {where}")
    if loaded.model is None:
        raise ReportError(f"--text-file needs a model, but {loaded.path} holds only tensors")
    ids: list[int] = []
    # tokenize in pieces (by paragraphs) so huge texts stop early at max_tokens
    for piece in re.split(r"(\n\s*\n)", text):
        if not piece:
            continue
        ids += tok(piece, add_special_tokens=False)["input_ids"]
        if len(ids) >= max_tokens:
            break
    ids = ids[:max_tokens]
    vocab = loaded.model.get_input_embeddings().weight.shape[0]
    if len(ids) < 2:
        raise ReportError(f"the text gives {len(ids)} token(s) with the tokenizer of {loaded.path}; need at least 2")
    t = torch.tensor(ids, dtype=torch.long)
    if int(t.max()) >= vocab:
        raise ReportError(f"the tokenizer of {loaded.path} gives id {int(t.max())} >= the model's vocabulary {vocab}")
    return t


def sequence_length(model: nn.Module, cap: int = 256) -> int:
    """Tokens per evaluation sequence: min(cap, the model's maximum positions)."""
    cfg = getattr(model, "config", None)
    limit = None
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        limit = limit or getattr(cfg, attr, None)
    return int(min(cap, limit or cap))


def text_blocks(ids: torch.Tensor, length: int) -> torch.Tensor:
    """Consecutive (B, length) blocks of `ids`; the remainder is dropped (one shorter block if
    the text is shorter than `length`)."""
    if len(ids) < length:
        return ids[None]
    return ids[: len(ids) // length * length].view(-1, length)


class _EncoderHandle(ModelHandle):
    """A `ModelHandle` for an encoder without an LM head: the input embedding plays the head
    (the frequency-group geometry reads its rows) and the blocks are found as in
    `OutputEmbeddingsHandle`."""

    def head(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def input_embedding(self) -> nn.Module | None:
        return None

    def blocks(self) -> list[nn.Module]:
        names = set(getattr(self.model, "_no_split_modules", None) or ())
        return [m for m in self.model.modules() if type(m).__name__ in names]


def text_pass(loaded: LoadedModel, ids: torch.Tensor, *, batch_size: int = 8, hidden_samples: int = 1000,
              progress: Callable | None = None, count_ids: torch.Tensor | None = None) -> dict[str, Any]:
    """One pass over the text with the built-in plugins: frequency groups from the token counts,
    per-group perplexity and Uniq (causal LMs), hidden-state anisotropy per block, and the
    gradient-bottleneck probe on the first batch (one backward in eval mode). `count_ids`: the
    tokens whose counts define the groups instead (e.g. the training text).

    The targets follow the model's loss (`aniso_plugins.core.targets`): a causal LM predicts the
    next token; a masked LM's and an encoder's positions hold their own token; an
    encoder-decoder reads the text on both sides (encoder input and decoder labels) and is
    measured on its decoder (no perplexity: a text alone has no source-target pairs)."""
    from aniso_plugins.core.config import AnisoConfig
    from aniso_plugins.core.plugins import AnisoPlugins
    from aniso_plugins.core.steps import StepInfo
    from aniso_plugins.core.targets import causal_targets

    model = loaded.model
    causal = loaded.kind == "causal-lm"
    seq2seq = loaded.kind == "seq2seq-lm"
    bar = progress or (lambda it, total, desc: it)
    metrics = ("frequency", "eval", "hidden", "bottleneck") if causal else ("frequency", "hidden")
    config = AnisoConfig(metrics=metrics, hidden_samples=hidden_samples, load_entry_points=False)
    plugins = AnisoPlugins(config)
    if causal or loaded.kind in ("masked-lm", "seq2seq-lm"):
        handle = OutputEmbeddingsHandle(model)
    else:
        handle = _EncoderHandle(model)
    length = sequence_length(model)
    blocks = text_blocks(ids, length)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    plugins.setup(handle)
    try:
        batches = list(blocks.split(batch_size))
        for i, x in enumerate(bar(batches, len(batches), f"{loaded.name}: text")):
            x = x.to(device)
            y = causal_targets(x, config.ignore_index) if causal else x  # labels as they are: masked, seq2seq
            inputs = {"input_ids": x, "labels": x} if seq2seq else {"input_ids": x}
            plugins.targets(y, StepInfo(step=1, micro_batch=i, measure=True))
            if i == 0 and causal:  # the bottleneck probe needs a backward (eval mode, grad on)
                with torch.enable_grad():
                    logits = model(input_ids=x).logits
                    loss = torch.nn.functional.cross_entropy(
                        logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), ignore_index=config.ignore_index
                    )
                    loss.backward()
                model.zero_grad(set_to_none=True)
            else:
                with torch.no_grad():
                    out = model(**inputs)
                logits = getattr(out, "logits", None)
            if causal:
                plugins.eval_batch(logits.detach(), y)
        plugins.step_end(StepInfo(step=1))
        if count_ids is not None:  # groups by another text's counts (its targets, as the text's own)
            counter = plugins.get("target_counts").counter
            y = causal_targets(text_blocks(count_ids, length), config.ignore_index) if causal else count_ids
            y = y.reshape(-1)
            counter.load_state_dict({"counts": torch.bincount(y[y != config.ignore_index], minlength=counter.vocab_size)})
        train = plugins.measure(StepInfo(step=1, measure=True), "train")
        evaluation = plugins.measure(StepInfo(step=1, measure=True), "eval") if causal else {}
        counts = plugins.get("target_counts").counter.counts.detach().cpu().clone()
    finally:
        handle.restore()
        model.train(was_training)
    groups = frequency_groups(counts, config.group_fractions)
    strip = lambda d, p: {k[len("aniso/" + p):]: v for k, v in d.items() if k.startswith("aniso/" + p)}  # noqa: E731
    layers = strip(train, "hidden/")
    out = {
        "tokens": int(ids.numel()),
        "sequence_length": int(blocks.shape[1]),
        "sequences": int(blocks.shape[0]),
        "counted_targets": int(counts.sum()),
        "groups_from": "text" if count_ids is None else "counts_text",
        "distinct_tokens": int((counts > 0).sum()),
        "group_sizes": {g: int((groups == i).sum()) for i, g in enumerate(GROUPS)},
        "group_token_share": {
            g: float(counts[groups == i].sum() / counts.sum().clamp_min(1)) for i, g in enumerate(GROUPS)
        },
        "frequency": strip(train, "frequency/"),
        "hidden_mean_cosine": [layers[f"layer_{i}/mean_cosine"] for i in range(len(layers))],
        "_counts": counts,
        "_groups": groups,
    }
    if causal:
        out["eval"] = strip(evaluation, "eval/")
        out["bottleneck"] = strip(train, "bottleneck/")
    return out


# --- the report -----------------------------------------------------------------------------
def _public(obj):
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

    def to_markdown(self) -> str:
        return render_markdown(self)

    def plot(self, directory: str | os.PathLike) -> list[str]:
        """Write the PNG plots into `directory`; returns their paths."""
        return render_plots(self, Path(directory))

    def write(self, directory: str | os.PathLike, plots: bool = True) -> list[str]:
        """report.json, report.md and (with `plots`) the PNGs into `directory`; returns the paths."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / "report.json").write_text(self.to_json() + "\n")
        (d / "report.md").write_text(self.to_markdown())
        return [str(d / "report.json"), str(d / "report.md")] + (self.plot(d) if plots else [])


def _progress_factory(enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None

    def bar(it, total, desc):
        return tqdm(it, total=total, desc=desc, leave=False, dynamic_ncols=True, mininterval=0.5)

    return bar


def analyze(
    models: Sequence[str | os.PathLike | nn.Module | torch.Tensor] | str | os.PathLike | nn.Module,
    text_file: str | os.PathLike | None = None,
    max_tokens: int = 100_000,
    postprocess: Sequence[str | Any] = (),
    tensor: str | Sequence[str] | None = None,
    progress: bool = True,
    *,
    text: str | None = None,
    tokenizer: Any = None,
    names: Sequence[str] | None = None,
    gram_rows: int | None = None,
    gram_flops: float = GRAM_FLOPS,
    batch_size: int = 8,
    hidden_samples: int = 1000,
    counts_file: str | os.PathLike | None = None,
    max_count_tokens: int = 10_000_000,
) -> Report:
    """Analyse one or several models (paths, modules or tensors) into one side-by-side `Report`.

    text_file / text: a corpus for the frequency groups, per-group perplexity and Uniq, the
    per-layer hidden-state anisotropy and the bottleneck probe (tokenized with the model dir's
    tokenizer, or `tokenizer` for in-memory models); max_tokens caps it. postprocess: names
    ("centering", "whitening", "zca", "all_but_the_top") or transform objects with
    ``fit``/``transform``. tensor: the safetensors tensor name(s) to read. counts_file: a text
    (e.g. the training text) whose token counts define the rare / medium / frequent groups
    instead of the text's own (its first `max_count_tokens` tokens). Raises `ReportError` on
    bad input."""
    if isinstance(models, (str, os.PathLike, nn.Module, torch.Tensor)):
        models = [models]
    if not models:
        raise ReportError("no MODEL given")
    tensors = [tensor] if isinstance(tensor, str) else (list(tensor) if tensor else None)
    if text_file is not None:
        try:
            text = Path(text_file).read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise ReportError(f"cannot read the text file {text_file}: {e.strerror or e}") from None
    count_text = None
    if counts_file is not None:
        if text is None:
            raise ReportError("--counts-file needs --text-file (the groups are used for the text's metrics)")
        try:
            count_text = Path(counts_file).read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise ReportError(f"cannot read the counts file {counts_file}: {e.strerror or e}") from None
    if max_tokens < 2:
        raise ReportError(f"max_tokens={max_tokens}: need at least 2")
    bar = _progress_factory(progress)
    transforms = [(p if isinstance(p, str) else type(p).__name__, p) for p in postprocess]
    transforms = [(n, _make_transform(p) if isinstance(p, str) else p) for n, p in transforms]
    loaded = [
        load_model(m, tensor=tensors, need_model=text is not None, name=(names[i] if names and i < len(names) else None))
        for i, m in enumerate(models)
    ]
    seen: dict[str, int] = {}
    for lm in loaded:  # unique labels
        if lm.name in seen:
            seen[lm.name] += 1
            lm.name = f"{lm.name} ({seen[lm.name]})"
        else:
            seen[lm.name] = 1
    out = []
    for lm in loaded:
        if tokenizer is not None and lm.tokenizer is None:
            lm.tokenizer = tokenizer
        entry: dict[str, Any] = {"name": lm.name, "path": lm.path, "kind": lm.kind, "tied": lm.tied, "matrices": {}}
        ids = _tokens(lm, text, max_tokens) if text is not None else None
        count_ids = _tokens(lm, count_text, max_count_tokens) if count_text is not None else None
        for key, source in lm.matrices.items():
            geo = matrix_geometry(source, gram_rows=gram_rows, gram_flops=gram_flops, progress=bar)
            post = {}
            for pname, proto in transforms:
                import copy

                t = _fit(copy.deepcopy(proto), source)
                post[pname] = {
                    k: v
                    for k, v in matrix_geometry(
                        source, transform=t, gram_rows=gram_rows, gram_flops=gram_flops, progress=bar, keep_rows=False
                    ).items()
                }
            if post:
                geo["postprocessed"] = post
            entry["matrices"][key] = geo
        if ids is not None:
            entry["text"] = text_pass(lm, ids, batch_size=batch_size, hidden_samples=hidden_samples, progress=bar,
                                      count_ids=count_ids)
        out.append(entry)
    settings = {
        "text_file": str(text_file) if text_file is not None else None,
        "counts_file": str(counts_file) if counts_file is not None else None,
        "max_tokens": max_tokens,
        "postprocess": [n for n, _ in transforms],
        "tensor": tensors,
        "gram_flops": gram_flops,
        "gram_rows": gram_rows,
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
) -> list[str]:
    """Write the report of one model (e.g. an in-memory model at the end of training) into
    `out_dir`: report.json, report.md and the PNGs (needs matplotlib; without it, only the
    JSON and Markdown). `text` + `tokenizer` (or the model dir's tokenizer with `text_file`)
    add the text-based parts. Returns the written paths. The model's mode and weights are left
    as they were."""
    report = analyze(
        [model], text_file=text_file, text=text, tokenizer=tokenizer, max_tokens=max_tokens,
        postprocess=postprocess, progress=progress, names=[name] if name else None,
    )
    if plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            plots = False
    return report.write(out_dir, plots=plots)

# --- rendering ------------------------------------------------------------------------------
_ROWS = (
    ("shape", None),
    ("gram", None),
    ("mean cosine", ("raw", "mean_cosine")),
    ("mean cosine (centred)", ("centered", "mean_cosine")),
    ("I(W)", ("raw", "isotropy")),
    ("I(W) (centred)", ("centered", "isotropy")),
    ("effective rank (centred, p∝σ)", ("centered", "effective_rank")),
    ("effective rank (centred, p∝σ²)", ("centered", "effective_rank_sigma2")),
    ("effective rank (raw, p∝σ)", ("raw", "effective_rank")),
    ("spectral saturation (raw)", ("raw", "singular_entropy")),
    ("σ_max (raw)", ("raw", "sigma_max")),
    ("σ/σ_max at k/2 (raw)", ("raw", "sv_normalized_q50")),
    ("top-1 variance share (centred)", ("centered", "variance_share_top1")),
    ("top-3 variance share (centred)", ("centered", "variance_share_top3")),
    ("IsoScore", ("isoscore",)),
    ("mean row norm", ("norm_mean",)),
    ("non-finite entries", ("nonfinite",)),
)


def _fmt(x: Any) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if not math.isfinite(x):
            return "nan" if math.isnan(x) else str(x)
        if x == 0:
            return "0"
        a = abs(x)
        return f"{x:.3e}" if a < 1e-3 or a >= 1e5 else f"{x:.4g}"
    return str(x)


def _get(d: dict, path: tuple[str, ...]) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def _columns(report: Report) -> list[tuple[str, dict]]:
    return [(f"{m['name']} · {k}", g) for m in report.models for k, g in m["matrices"].items()]


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _geometry_table(columns: list[tuple[str, dict]]) -> str:
    rows = []
    for label, path in _ROWS:
        if label == "shape":
            rows.append([label] + [f"{g.get('rows', '?')} × {g.get('dim', '?')} {g.get('dtype', '')}".strip() for _, g in columns])
        elif label == "gram":
            rows.append(["Gram"] + [str(g.get("gram", "")) for _, g in columns])
        else:
            rows.append([label] + [_fmt(_get(g, path)) for _, g in columns])
    return _table(["metric"] + [c for c, _ in columns], rows)


def render_markdown(report: Report) -> str:
    """The report's tables as Markdown."""
    md = ["# Embedding geometry report", ""]
    md.append(", ".join(f"**{m['name']}** ({m['kind']}{', tied' if m.get('tied') else ''}): `{m['path']}`" for m in report.models))
    md += ["", "## Geometry", "", _geometry_table(_columns(report)), ""]
    for pname in report.settings.get("postprocess") or []:
        cols = [(c, g["postprocessed"][pname]) for c, g in _columns(report) if pname in g.get("postprocessed", {})]
        md += [f"## After {pname}", "", _geometry_table(cols), ""]
    with_text = [m for m in report.models if "text" in m]
    if with_text:
        md += ["## Text", ""]
        rows = [
            ["tokens"] + [_fmt(m["text"]["tokens"]) for m in with_text],
            ["sequences × length"] + [f"{m['text']['sequences']} × {m['text']['sequence_length']}" for m in with_text],
            ["distinct tokens"] + [_fmt(m["text"]["distinct_tokens"]) for m in with_text],
        ]
        for g in GROUPS:
            rows.append([f"{g}: ids / share of tokens"] + [
                f"{m['text']['group_sizes'][g]:,} / {m['text']['group_token_share'][g]:.3f}" for m in with_text])
        for key in ("ppl", *[f"ppl_{g}" for g in GROUPS], "uniq", *[f"uniq_{g}" for g in GROUPS]):
            if any(key in m["text"].get("eval", {}) for m in with_text):
                rows.append([f"eval {key}"] + [_fmt(m["text"].get("eval", {}).get(key)) for m in with_text])
        for g in GROUPS:
            for key in ("isotropy", "mean_cosine"):
                rows.append([f"{g} rows: {'I(W)' if key == 'isotropy' else 'mean cosine'}"] + [
                    _fmt(m["text"]["frequency"].get(f"{g}/{key}")) for m in with_text])
        rows.append(["rare–frequent mean cosine"] + [_fmt(m["text"]["frequency"].get("rare_frequent_cosine")) for m in with_text])
        for key in ("lost_fraction", "kept_cosine", "tokens"):
            if any(key in m["text"].get("bottleneck", {}) for m in with_text):
                rows.append([f"bottleneck {key}"] + [_fmt(m["text"].get("bottleneck", {}).get(key)) for m in with_text])
        md += [_table(["text metric"] + [m["name"] for m in with_text], rows), ""]
        n_layers = max(len(m["text"]["hidden_mean_cosine"]) for m in with_text)
        rows = [[str(i)] + [_fmt(m["text"]["hidden_mean_cosine"][i]) if i < len(m["text"]["hidden_mean_cosine"]) else "–"
                            for m in with_text] for i in range(n_layers)]
        md += ["### Hidden-state anisotropy (mean cosine of sampled token occurrences, per block)", "",
               _table(["block"] + [m["name"] for m in with_text], rows), ""]
    return "\n".join(md) + "\n"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ReportError("plots need matplotlib (pip install aniso-plugins[report])") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def render_plots(report: Report, directory: Path) -> list[str]:
    """spectrum.png, cosines.png, projection.png and, with a text, layers.png and
    norm_frequency.png; returns the paths written."""
    plt = _pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    cols = _columns(report)

    def save(fig, name):
        path = directory / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))

    # 1. normalised singular-value spectrum
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, g in cols:
        sv = [max(x, 1e-12) for x in g["spectrum"]]
        ax.plot(range(1, len(sv) + 1), sv, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("index i")
    ax.set_ylabel("σ_i / σ_1")
    ax.set_title("Normalised singular values (raw)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, "spectrum.png")

    # 2. pairwise cosines, before and after post-processing
    panels = [("raw", "cosine_histogram", None), ("centred", "cosine_histogram_centered", None)]
    panels += [(p, "cosine_histogram", p) for p in report.settings.get("postprocess") or []]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (title, key, post) in zip(axes[0], panels):
        for label, g in cols:
            src = g if post is None else g.get("postprocessed", {}).get(post)
            if not src:
                continue
            h = src[key]
            n = len(h["counts"])
            edges = [h["min"] + (h["max"] - h["min"]) * i / n for i in range(n + 1)]
            total = max(1, sum(h["counts"]))
            width = (h["max"] - h["min"]) / n
            ax.stairs([c / total / width for c in h["counts"]], edges, label=label)
        ax.set_title(f"pairwise cosines: {title}")
        ax.set_xlabel("cos(w_i, w_j), sampled rows")
        ax.set_ylabel("density")
        ax.legend(fontsize=7)
    save(fig, "cosines.png")

    # 3. 2-D projection on the top two singular directions, coloured by frequency group
    items = [(m, k, g) for m in report.models for k, g in m["matrices"].items() if "_projection" in g]
    if items:
        n = len(items)
        ncols = min(n, 3)
        nrows = math.ceil(n / ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 4.0 * nrows), squeeze=False)
        for ax in axes.flat[n:]:
            ax.set_visible(False)
        colors = {0: "tab:red", 1: "tab:orange", 2: "tab:blue"}
        for ax, (m, k, g) in zip(axes.flat, items):
            xy = g["_projection"]
            gen = torch.Generator().manual_seed(0)
            pick = torch.randperm(len(xy), generator=gen)[:PROJECTION_POINTS]
            groups = m.get("text", {}).get("_groups")
            if groups is not None and len(groups) == len(xy):
                for gi in (1, 2, 0):
                    sel = pick[groups[pick] == gi]
                    ax.scatter(xy[sel, 0], xy[sel, 1], s=3, alpha=0.6, c=colors[gi], label=GROUPS[gi], linewidths=0)
                ax.legend(fontsize=7, markerscale=3)
            else:
                ax.scatter(xy[pick, 0], xy[pick, 1], s=3, alpha=0.5, linewidths=0)
            ax.set_title(f"{m['name']} · {k}", fontsize=9)
            ax.set_xlabel("⟨w, u_1⟩")
            ax.set_ylabel("⟨w, u_2⟩")
        save(fig, "projection.png")

    with_text = [m for m in report.models if "text" in m]
    if with_text:
        # 4. per-layer hidden-state anisotropy
        fig, ax = plt.subplots(figsize=(6.0, 4.0))
        for m in with_text:
            y = m["text"]["hidden_mean_cosine"]
            ax.plot(range(len(y)), y, marker="o", label=m["name"])
        ax.set_xlabel("block")
        ax.set_ylabel("mean cosine of random token occurrences")
        ax.set_title("Hidden-state anisotropy per layer")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, "layers.png")

        # 5. token norm against token frequency
        kinds = sorted({k for m in with_text for k, g in m["matrices"].items() if "_norms" in g})
        fig, axes = plt.subplots(1, len(kinds), figsize=(5.0 * len(kinds), 4.0), squeeze=False)
        for ax, k in zip(axes[0], kinds):
            for m in with_text:
                g = m["matrices"].get(k)
                counts = m["text"]["_counts"]
                if g is None or "_norms" not in g or len(g["_norms"]) != len(counts):
                    continue
                gen = torch.Generator().manual_seed(0)
                pick = torch.randperm(len(counts), generator=gen)[:PROJECTION_POINTS]
                ax.scatter(counts[pick].double() + 1, g["_norms"][pick], s=3, alpha=0.4, label=m["name"], linewidths=0)
            ax.set_xscale("log")
            ax.set_xlabel("token count in the text + 1")
            ax.set_ylabel("row norm ‖w_i‖")
            ax.set_title(f"norm vs frequency: {k}")
            ax.legend(fontsize=7, markerscale=3)
        save(fig, "norm_frequency.png")
    return written


__all__ = ["MatrixSource", "Report", "ReportError", "analyze", "load_model", "matrix_geometry", "text_pass", "write_report"]
