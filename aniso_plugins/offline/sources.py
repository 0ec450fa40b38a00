"""Where the report's matrices come from: a (V, d) matrix as a `MatrixSource` read in row
blocks, and one MODEL argument resolved into them (`load_model`): a local Hugging Face model
directory (loaded offline; its embedding and untied head streamed from safetensors when the
model itself is not needed), a safetensors file or a directory of them (embedding-like 2-D
tensors, or ``tensor=NAME``, read with ``safe_open(...).get_slice(name)[a:b]``), a Lightning
``.ckpt``, a DCP checkpoint folder (torchtitan's, or an HF Trainer's under FSDP) or a DeepSpeed
ZeRO checkpoint (`aniso_plugins.offline.checkpoints`), or an in-memory ``nn.Module`` / 2-D tensor."""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aniso_plugins.core.errors import SetupError
from aniso_plugins.metrics.geometry.stats import BLOCK_ROWS
from aniso_plugins.models.handle import output_projection
from aniso_plugins.offline.checkpoints import (
    dcp_folder,
    dcp_tensors,
    deepspeed_folder,
    lightning_tensors,
    zero_tensors,
)
from aniso_plugins.offline.errors import ReportError, install_hint
from aniso_plugins.offline.errors import one_line as _one_line

_EMBEDDING_NAME = re.compile(r"(embed|wte|word_embeddings|lm_head|tok_embeddings|(^|\.)output\.weight$|decoder\.weight$)")


@dataclass
class MatrixSource:
    """A (V, d) matrix read in row blocks: ``blocks()`` yields (offset, rows) with rows in the
    stored dtype."""

    name: str
    shape: tuple[int, int]
    dtype: str
    read: Callable[[int, int], torch.Tensor]

    def blocks(self, block_rows: int = BLOCK_ROWS) -> Iterator[tuple[int, torch.Tensor]]:
        """(offset, rows) of consecutive blocks of `block_rows` rows, in order."""
        for a in range(0, self.shape[0], block_rows):
            yield a, self.read(a, min(a + block_rows, self.shape[0]))

    @classmethod
    def of_tensor(cls, name: str, weight: torch.Tensor) -> MatrixSource:
        """An in-memory 2-D floating-point tensor (detached; blocks are views of it)."""
        w = weight.detach()
        if w.dim() != 2 or not w.is_floating_point():
            raise ReportError(f"{name}: expected a 2-D floating-point tensor, got {tuple(w.shape)} {w.dtype}")
        return cls(name, (int(w.shape[0]), int(w.shape[1])), str(w.dtype).replace("torch.", ""), lambda a, b: w[a:b])


def _safetensors_sources(path: Path, names: Sequence[str] | None) -> list[MatrixSource]:
    """The tensors `names` of a safetensors file, or its embedding-like 2-D floating tensors
    (`_EMBEDDING_NAME`), each streamed by slices."""
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


@dataclass
class LoadedModel:
    """One resolved MODEL: its matrices, and the model and tokenizer when the text pass can run."""

    name: str
    path: str
    kind: str  # "causal-lm", "masked-lm", "seq2seq-lm", "encoder", "safetensors", "module", "tensor"
    matrices: dict[str, MatrixSource]
    tied: bool | None = None
    model: nn.Module | None = None
    tokenizer: Any = None
    notes: list[str] = field(default_factory=list)


_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def _quiet_transformers():
    """transformers, with its logging at errors only and its progress bars off."""
    import transformers

    transformers.logging.set_verbosity_error()
    with contextlib.suppress(Exception):
        transformers.utils.logging.disable_progress_bar()
    return transformers


def _model_kind(config) -> str:
    """causal-lm, masked-lm, seq2seq-lm or encoder, from an HF config's architectures."""
    archs = " ".join(getattr(config, "architectures", None) or [])
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq-lm"
    if "CausalLM" in archs or "LMHeadModel" in archs:
        return "causal-lm"
    if "MaskedLM" in archs:
        return "masked-lm"
    return "encoder"


def _modules_from(model: nn.Module) -> tuple[dict[str, MatrixSource], bool | None]:
    """A module's input embedding and, when it is a separate matrix, its output embedding;
    and whether the two are tied (None without an output embedding)."""
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


def _weight_map(path: Path) -> dict[str, str] | None:
    """Parameter name -> safetensors file of an HF model directory (its index, or the one
    ``model.safetensors``); None without safetensors weights or with an unreadable index."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            return json.loads(index.read_text())["weight_map"]
        except Exception:
            return None
    if not (path / "model.safetensors").exists():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            return dict.fromkeys(f.keys(), "model.safetensors")
    except Exception as e:
        raise ReportError(f"cannot read safetensors file {path / 'model.safetensors'}: {_one_line(e)}") from None


def _meta_embeddings(config, auto) -> tuple[dict[str, torch.Tensor], bool | None, dict[int, list[str]]] | None:
    """The embedding (and untied head) parameters of the model built on the meta device, the
    tied flag, and every parameter's names (by id); None when the model cannot be built."""
    try:
        with torch.device("meta"):
            model = auto.from_config(config)
        emb = model.get_input_embeddings()
    except Exception:
        return None
    try:  # the module that makes the logits (FSMT: not get_output_embeddings())
        head = model.get_submodule(output_projection(model))
    except SetupError:
        head = None
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
    return wanted, tied, names


def _hf_stream_sources(path: Path, config, auto) -> tuple[dict[str, MatrixSource], bool | None] | None:
    """The embedding (and untied head) of an HF model directory as streamed safetensors
    tensors, without loading the model: the parameter names come from the model built on the
    meta device. None when that does not work (no safetensors, renamed keys): load it then."""
    weight_map = _weight_map(path)
    if weight_map is None:
        return None
    meta = _meta_embeddings(config, auto)
    if meta is None or not meta[0]:
        return None
    wanted, tied, names = meta
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


def _in_memory(spec: nn.Module | torch.Tensor, name: str | None) -> LoadedModel:
    """A 2-D tensor (one matrix) or a module (its input embedding and untied head)."""
    if isinstance(spec, torch.Tensor):
        return LoadedModel(name or "tensor", "<tensor>", "tensor", {"matrix": MatrixSource.of_tensor("matrix", spec)})
    matrices, tied = _modules_from(spec)
    if not matrices:
        raise ReportError(f"{type(spec).__name__} has no input or output embedding (get_input_embeddings())")
    cfg = getattr(spec, "config", None)
    kind = _model_kind(cfg) if cfg is not None else ("causal-lm" if "head" in matrices or tied else "module")
    return LoadedModel(name or type(spec).__name__, "<in memory>", kind, matrices, tied, spec)


def _label(path: Path, name: str | None) -> str:
    """The column name of a path: `name`, ``run/checkpoint-N`` for a Trainer checkpoint, or the
    path's last part."""
    label = name or (path.name if path.name else str(path))
    if path.parent.name and path.name.startswith("checkpoint-"):
        label = name or f"{path.parent.name}/{path.name}"
    return label


EXPECTED_MODEL = ("a Hugging Face model directory (config.json and weights, e.g. a Trainer checkpoint-N), a .safetensors "
                  "file, a Lightning .ckpt or a torchtitan/DCP checkpoint folder")
"""What a MODEL argument can be, for the messages that refuse one."""


def _looks_like_safetensors(path: Path) -> bool:
    """Whether `path` starts as a safetensors file does: an 8-byte little-endian header length
    that fits in the file, then the JSON header's ``{``."""
    with open(path, "rb") as f:
        start = f.read(9)
    if len(start) < 9:
        return False
    n = int.from_bytes(start[:8], "little")
    return 2 <= n <= path.stat().st_size - 8 and start[8:9] == b"{"


def _checkpoint_number(p: Path) -> int:
    return int(p.name.removeprefix("checkpoint-"))


def _not_a_model_folder(path: Path, why: str) -> str:
    """Why the folder `path` is no model: a training output folder (its ``checkpoint-N``
    listed, the latest suggested) or `why` it holds no weights."""
    checkpoints = sorted((p for p in path.iterdir() if p.is_dir() and re.fullmatch(r"checkpoint-\d+", p.name)),
                         key=_checkpoint_number)
    if checkpoints:
        names = ", ".join(p.name for p in checkpoints[-10:])
        more = f" (the last 10 of {len(checkpoints)})" if len(checkpoints) > 10 else ""
        return (f"{path} is a training output folder, not a model directory: it holds the checkpoints {names}{more}; "
                f"report one of them, e.g. the latest: aniso report {checkpoints[-1]}")
    return f"{path} {why}"


def _safetensors_model(path: Path, label: str, tensor: Sequence[str] | None) -> LoadedModel | None:
    """A safetensors file, a directory of them without config.json, or the tensors named by
    `tensor` in an HF model directory; None for an HF model directory to load as a model."""
    if path.is_file():
        if path.suffix != ".safetensors" and not _looks_like_safetensors(path):
            raise ReportError(f"{path} is not a model: expected {EXPECTED_MODEL}")
        return LoadedModel(label, str(path), "safetensors", {s.name: s for s in _safetensors_sources(path, tensor)})
    if not (path / "config.json").exists():
        files = sorted(path.glob("*.safetensors"))
        if files:
            sources = [s for f in files for s in _safetensors_sources(f, tensor)]
            return LoadedModel(label, str(path), "safetensors", {s.name: s for s in sources})
        raise ReportError(_not_a_model_folder(
            path, f"is not a model directory: no config.json and no *.safetensors weights; expected {EXPECTED_MODEL}"))
    if not any((path / f).exists() for f in _WEIGHT_FILES) and not list(path.glob("*.safetensors")):
        raise ReportError(_not_a_model_folder(
            path, "has a config.json but no weights (model.safetensors or pytorch_model.bin)"))
    if not tensor:
        return None
    sources = []
    for f in sorted(path.glob("*.safetensors")):
        with contextlib.suppress(ReportError):
            sources += _safetensors_sources(f, [t for t in tensor])
    if not sources:
        raise ReportError(f"no tensor {tensor[0]!r} in the safetensors files of {path}")
    return LoadedModel(label, str(path), "safetensors", {s.name: s for s in sources})


def _hf_config(path: Path):
    """transformers (quiet, offline) and the directory's config."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        transformers = _quiet_transformers()
    except ImportError:
        raise ReportError("a Hugging Face model directory needs transformers: pip install transformers, or "
                          f"{install_hint('hf')}") from None
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise ReportError(f"cannot read the config of {path}: {_one_line(e)}") from None
    return transformers, config


def _hf_model(path: Path, label: str, need_model: bool) -> LoadedModel:
    """An HF model directory: its tokenizer (when it has tokenizer files) and its embedding
    and untied head, streamed from safetensors unless `need_model` (the text pass) or the
    parameter names do not match, loaded with the Auto class of its kind otherwise."""
    transformers, config = _hf_config(path)
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


def _trainer_checkpoint(path: Path, label: str, embedding: str | None, head: str | None,
                        need_model: bool) -> LoadedModel | None:
    """A Lightning ``.ckpt``, a DCP checkpoint folder (torchtitan's; an HF Trainer's FSDP
    ``SHARDED_STATE_DICT`` one) or a DeepSpeed ZeRO checkpoint; None for anything else.

    A DeepSpeed ``checkpoint-N`` that also holds an HF ``model.safetensors`` is read from its ZeRO
    shards: they are the fp32 master weights the optimizer trained, whereas the Trainer's
    ``model.safetensors`` is absent (or empty placeholders) under ZeRO-3 without
    ``stage3_gather_16bit_weights_on_model_save``, and otherwise the engine's module weights,
    16-bit under bf16/fp16 training. Name that file (``checkpoint-N/model.safetensors``) to
    report it instead."""
    if path.is_file() and path.suffix == ".ckpt":
        tensors, tied = lightning_tensors(path, embedding, head)
        kind = "lightning"
    elif path.is_dir() and (zero := deepspeed_folder(path)) is not None:
        if need_model:
            raise ReportError(f"--text-file needs a Hugging Face model folder; {path} is a DeepSpeed ZeRO checkpoint "
                              "(its matrices are reported without a text); write one with `python -m "
                              f"deepspeed.utils.zero_to_fp32 {zero[0]} OUT -t {zero[1]} --safe_serialization`, then "
                              "copy config.json and the tokenizer files into OUT")
        tensors, tied = zero_tensors(*zero, embedding, head)
        kind, path = "deepspeed", zero[0] / zero[1]
    elif path.is_dir() and (dcp := dcp_folder(path)) is not None:
        tensors, tied = dcp_tensors(dcp[0], embedding, head, prefix=dcp[1])
        kind, path = "dcp", dcp[0]
    else:
        return None
    matrices = {role: MatrixSource.of_tensor(role, t) for role, t in tensors.items()}
    return LoadedModel(label, str(path), kind, matrices, tied)


def load_model(spec: str | os.PathLike | nn.Module | torch.Tensor, *, tensor: Sequence[str] | None = None,
               need_model: bool = False, name: str | None = None, embedding: str | None = None,
               head: str | None = None) -> LoadedModel:
    """Resolve one MODEL argument (see the module docstring). Raises `ReportError`."""
    if isinstance(spec, (torch.Tensor, nn.Module)):
        return _in_memory(spec, name)
    path = Path(spec)
    label = _label(path, name)
    if not path.exists():
        raise ReportError(f"no such file or directory: {path}")
    loaded = _trainer_checkpoint(path, label, embedding, head, need_model)
    if loaded is not None:
        return loaded
    loaded = _safetensors_model(path, label, tensor)
    return loaded if loaded is not None else _hf_model(path, label, need_model)


__all__ = ["LoadedModel", "MatrixSource", "load_model"]
