"""Where the report's matrices come from: a (V, d) matrix as a `MatrixSource` read in row
blocks, and one MODEL argument resolved into them (`load_model`): a local Hugging Face model
directory (loaded offline; its embedding and untied head streamed from safetensors when the
model itself is not needed), a safetensors file or a directory of them (embedding-like 2-D
tensors, or ``tensor=NAME``, read with ``safe_open(...).get_slice(name)[a:b]``), a Lightning
``.ckpt``, a DCP checkpoint folder (torchtitan's, or an HF Trainer's under FSDP) or a DeepSpeed
ZeRO checkpoint (`aniso_plugins.offline.checkpoints`), or an in-memory ``nn.Module`` / 2-D tensor.

A low-rank LM head (``lm_head.A`` and ``lm_head.B``; the rule and the product in
`aniso_plugins.offline.checkpoints`) is read as W = A·B from each of them, and the model's
``notes`` say so."""

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
    HeadNote,
    LowRankFactors,
    dcp_folder,
    dcp_tensors,
    deepspeed_folder,
    factors_beside,
    head_factors,
    lightning_tensors,
    low_rank_head,
    product_dtype,
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


_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


class _Safetensors:
    """The tensors of one or several safetensors files by name (the first file holding a name),
    each read by slices, ``safe_open(...).get_slice(name)[a:b]``: a file is never loaded whole."""

    def __init__(self, paths: Sequence[Path]) -> None:
        from safetensors import safe_open

        self.slices: dict[str, Any] = {}
        self._files = []  # kept open while their slices are read
        for path in paths:
            try:
                f = safe_open(str(path), framework="pt")
                keys = list(f.keys())
            except Exception as e:  # SafetensorError, OSError, header errors
                raise ReportError(f"cannot read safetensors file {path}: {_one_line(e)}") from None
            self._files.append(f)
            for key in keys:
                self.slices.setdefault(key, f.get_slice(key))

    def shape(self, key: str) -> list[int]:
        return list(self.slices[key].get_shape())

    def two_d(self) -> list[str]:
        """The names of the 2-D floating-point tensors."""
        return [k for k, sl in self.slices.items() if len(sl.get_shape()) == 2 and sl.get_dtype().startswith(("F", "BF"))]

    def source(self, key: str, name: str | None = None) -> MatrixSource:
        sl = self.slices[key]
        v, d = self.shape(key)
        return MatrixSource(name or key, (v, d), _DTYPES.get(sl.get_dtype(), sl.get_dtype()),
                            lambda a, b, sl=sl, files=self._files: sl[a:b])

    def tensor(self, key: str) -> torch.Tensor:
        return self.slices[key][:]

    def low_rank(self, factors: LowRankFactors, name: str) -> tuple[MatrixSource | None, HeadNote]:
        """The head of `factors` (`low_rank_head`): A·B as a source named `name`, read by row
        blocks of A; or None beside a stored weight, checked against A·B. Its note."""
        a, b = self.slices[factors.a], self.tensor(factors.b)
        weight = None if factors.weight is None else self.slices[factors.weight]
        read, note = low_rank_head(factors, lambda i, j: a[i:j], b, None if weight is None else lambda i, j: weight[i:j])
        if read is None:
            return None, note
        dtype = product_dtype(a[0:1].dtype, b.dtype)
        return MatrixSource(name, factors.shape, str(dtype).replace("torch.", ""), read), note


def _safetensors_sources(files: _Safetensors, names: Sequence[str] | None,
                         where: Path) -> tuple[list[MatrixSource], list[HeadNote]]:
    """The tensors `names` of safetensors files (`where`: the file or folder), or their
    embedding-like 2-D floating tensors (`_EMBEDDING_NAME`), each streamed by slices; a low-rank
    head's factors (``lm_head.A``, ``lm_head.B``) as their product, named as the head's weight
    would be (``lm_head.weight``) — or the weight itself, when it is there. With the notes of
    the low-rank head."""
    two_d = files.two_d()
    shapes = {k: files.shape(k) for k in two_d}
    listing = ", ".join(two_d[:12]) or "none"
    picked: list[tuple[str, str | None, LowRankFactors | None]] = []  # (name, stored key, factors)
    if names:
        for name in names:
            if name in files.slices and name not in two_d:
                continue  # refused below
            key, factors = head_factors(shapes, name, str(where))  # a head named by its weight or module: A·B
            if key is None and factors is None:
                raise ReportError(f"{where} has no tensor {name!r} (2-D tensors: {listing})")
            picked.append((name, key, factors))
        bad = [n for n in names if n in files.slices and n not in two_d]
        if bad:
            raise ReportError(f"tensor {bad[0]!r} in {where} is not a 2-D floating-point tensor {files.shape(bad[0])}")
    else:
        weight, factors = head_factors(shapes, None, str(where))
        skip = () if factors is None else (factors.a, factors.b)
        picked = [(k, k, factors if k == weight else None) for k in two_d if _EMBEDDING_NAME.search(k) and k not in skip]
        if factors is not None and weight is None:
            picked.append((factors.a[: -len(".A")] + ".weight", None, factors))
        if not picked:
            raise ReportError(f"{where} has no embedding-like 2-D tensor (2-D tensors: {listing}); "
                              "name one with --tensor NAME")
    out, notes = [], []
    for name, key, factors in picked:
        source = None
        if factors is not None:
            source, note = files.low_rank(factors, name)
            notes.append(note)
        out.append(source if source is not None else files.source(key or factors.weight, name))
    return out, notes


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
    """What the report says about how the model was read (e.g. a low-rank head read as A·B)."""
    warnings: list[str] = field(default_factory=list)
    """The notes that are warnings (e.g. a stored head weight that is not A·B of its factors)."""

    def add(self, notes: Sequence[HeadNote | None]) -> LoadedModel:
        """Add `notes` (None: nothing) to ``notes``, the warnings also to ``warnings``."""
        for note in notes:
            if note is not None:
                self.notes.append(note.text)
                if note.warning:
                    self.warnings.append(note.text)
        return self


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


def _modules_from(model: nn.Module) -> tuple[dict[str, MatrixSource], bool | None, list[HeadNote]]:
    """A module's input embedding and, when it is a separate matrix, its output embedding;
    whether the two are tied (None without an output embedding); a low-rank head
    (`aniso_plugins.methods.heads.lowrank.LowRankHead`: 2-D ``A`` and ``B``) is read as the
    float64 product of its factors, with its note."""
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
    notes = []
    factors = _module_factors(model, head)
    if factors is not None:
        read, note = low_rank_head(factors, lambda i, j: head.A[i:j], head.B, None)
        hw, notes = read(0, factors.shape[0]), [note]
    else:
        hw = getattr(head, "weight", None) if head is not None else None
    matrices: dict[str, MatrixSource] = {}
    if isinstance(ew, torch.Tensor) and ew.dim() == 2:
        matrices["embedding"] = MatrixSource.of_tensor("embedding", ew)
    tied = None
    if isinstance(hw, torch.Tensor) and hw.dim() == 2:
        tied = isinstance(ew, torch.Tensor) and (hw is ew or hw.data_ptr() == ew.data_ptr())
        if not tied:
            matrices["head"] = MatrixSource.of_tensor("head", hw)
    return matrices, tied, notes


def _module_factors(model: nn.Module, head: nn.Module | None) -> LowRankFactors | None:
    """The factors of an in-memory low-rank head (2-D ``A`` and ``B`` that chain, and no
    ``weight`` of its own), named by its path in `model`."""
    a, b = getattr(head, "A", None), getattr(head, "B", None)
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or "weight" in {*head._parameters, *head._buffers}:
        return None
    where = next((n for n, m in model.named_modules() if m is head), "") or "head"
    try:
        return factors_beside({f"{where}.A": a.shape, f"{where}.B": b.shape}, where, type(model).__name__)
    except ReportError:  # A and B of another kind
        return None


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


def _hf_stream_sources(path: Path, config, auto) -> tuple[dict[str, MatrixSource], bool | None, list[HeadNote]] | None:
    """The embedding (and untied head) of an HF model directory as streamed safetensors
    tensors, without loading the model: the parameter names come from the model built on the
    meta device; a low-rank head is read as the product of the factors beside its weight's name
    (``lm_head.A``, ``lm_head.B``), or, with that weight stored too, the weight checked against
    it (the notes). None when that does not work (no safetensors, renamed keys): load it then."""
    weight_map = _weight_map(path)
    if weight_map is None:
        return None
    meta = _meta_embeddings(config, auto)
    if meta is None or not meta[0]:
        return None
    wanted, tied, names = meta
    files = _Safetensors([path / f for f in sorted(set(weight_map.values()))])
    shapes = {k: files.shape(k) for k in files.slices}
    matrices, notes = {}, []
    for key, param in wanted.items():
        candidates = names.get(id(param), [])
        if key == "head":
            factors = next((f for n in candidates if (f := factors_beside(shapes, n, str(path))) is not None), None)
            if factors is not None:
                if factors.shape != tuple(param.shape):
                    return None
                source, note = files.low_rank(factors, key)
                notes.append(note)
                if source is not None:
                    matrices[key] = source
                    continue
        found = [n for n in candidates if n in files.slices]
        if not found:
            return None
        source = files.source(found[0], key)
        if source.shape != tuple(param.shape):
            return None
        matrices[key] = source
    return matrices, tied, notes


def _in_memory(spec: nn.Module | torch.Tensor, name: str | None) -> LoadedModel:
    """A 2-D tensor (one matrix) or a module (its input embedding and untied head)."""
    if isinstance(spec, torch.Tensor):
        return LoadedModel(name or "tensor", "<tensor>", "tensor", {"matrix": MatrixSource.of_tensor("matrix", spec)})
    matrices, tied, notes = _modules_from(spec)
    if not matrices:
        raise ReportError(f"{type(spec).__name__} has no input or output embedding (get_input_embeddings())")
    cfg = getattr(spec, "config", None)
    kind = _model_kind(cfg) if cfg is not None else ("causal-lm" if "head" in matrices or tied else "module")
    return LoadedModel(name or type(spec).__name__, "<in memory>", kind, matrices, tied, spec).add(notes)


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
        return _safetensors_loaded(label, path, [path], tensor)
    if not (path / "config.json").exists():
        files = sorted(path.glob("*.safetensors"))
        if files:
            return _safetensors_loaded(label, path, files, tensor)
        raise ReportError(_not_a_model_folder(
            path, f"is not a model directory: no config.json and no *.safetensors weights; expected {EXPECTED_MODEL}"))
    if not any((path / f).exists() for f in _WEIGHT_FILES) and not list(path.glob("*.safetensors")):
        raise ReportError(_not_a_model_folder(
            path, "has a config.json but no weights (model.safetensors or pytorch_model.bin)"))
    if not tensor:
        return None
    return _safetensors_loaded(label, path, sorted(path.glob("*.safetensors")), tensor)


def _safetensors_loaded(label: str, path: Path, files: Sequence[Path], tensor: Sequence[str] | None) -> LoadedModel:
    """The safetensors `files` (of `path`, a file or a folder) as one model (`_safetensors_sources`)."""
    sources, notes = _safetensors_sources(_Safetensors(files), tensor, path)
    return LoadedModel(label, str(path), "safetensors", {s.name: s for s in sources}).add(notes)


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
            matrices, tied, notes = streamed
            return LoadedModel(label, str(path), kind, matrices, tied, None, tokenizer).add(notes)
    try:
        model, info = auto.from_pretrained(str(path), local_files_only=True, dtype="auto", output_loading_info=True)
    except Exception as e:
        raise ReportError(f"cannot load the model in {path}: {_one_line(e)}") from None
    model.eval()
    notes = _loaded_head(model, path, info)
    matrices, tied, _ = _modules_from(model)
    if not matrices:
        raise ReportError(f"the model in {path} ({type(model).__name__}) has no input or output embedding")
    return LoadedModel(label, str(path), kind, matrices, tied, model, tokenizer).add(notes)


def _checkpoint_tensors(path: Path) -> tuple[dict[str, list[int]], Callable[[str], torch.Tensor]]:
    """Every tensor's shape in an HF model directory's weight files (safetensors, or
    ``pytorch_model.bin`` and its shards, read with ``torch.load(weights_only=True, mmap=True)``),
    and a reader of one tensor by name."""
    weight_map = _weight_map(path)
    if weight_map is not None:
        files = _Safetensors([path / f for f in sorted(set(weight_map.values()))])
        return {k: files.shape(k) for k in files.slices}, files.tensor
    index = path / "pytorch_model.bin.index.json"
    state: dict[str, Any] = {}
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["pytorch_model.bin"]
        for name in names:
            state.update(torch.load(path / name, map_location="cpu", weights_only=True, mmap=True))
    except Exception as e:
        raise ReportError(f"cannot read the weights of {path}: {_one_line(e)}") from None
    return {k: list(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}, state.__getitem__


def _loaded_head(model: nn.Module, path: Path, info: dict[str, Any]) -> list[HeadNote]:
    """Make the loaded model's untied LM head what the directory holds: ``from_pretrained`` leaves
    a weight missing from the files randomly initialised, so a low-rank head's product A·B (of the
    factors beside the weight's name, ``lm_head.A`` and ``lm_head.B``) is set into it, and a head
    missing without factors is refused (`ReportError`); a stored weight beside the factors is
    checked against their product. The notes."""
    try:
        module = output_projection(model)
        weight = getattr(model.get_submodule(module), "weight", None)
        emb = getattr(model.get_input_embeddings(), "weight", None)
    except (SetupError, AttributeError, NotImplementedError):
        return []
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight is emb:
        return []
    name = f"{module}.weight"
    missing = name in set(info.get("missing_keys") or ())
    if not missing and not {f"{module}.A", f"{module}.B"} <= set(info.get("unexpected_keys") or ()):
        return []
    shapes, tensor = _checkpoint_tensors(path)
    factors = factors_beside(shapes, name, str(path))
    if factors is None:
        raise ReportError(f"{path} has no {name} (the LM head's weight), nor a low-rank head's {module}.A and "
                          f"{module}.B beside it: transformers would initialise it at random, and the report would be "
                          "that random head's")
    if factors.shape != tuple(weight.shape):
        raise ReportError(f"{path}: {factors.a} and {factors.b} make a {factors.shape[0]}×{factors.shape[1]} head, "
                          f"but the model's {name} is {weight.shape[0]}×{weight.shape[1]}")
    a, b = tensor(factors.a), tensor(factors.b)
    read, note = low_rank_head(factors, lambda i, j: a[i:j], b, None if missing else lambda i, j: weight[i:j])
    if read is not None:
        with torch.no_grad():
            weight.copy_(read(0, factors.shape[0]))
    return [note]


def _trainer_checkpoint(path: Path, label: str, embedding: str | None, head: str | None,
                        need_model: bool, trust: bool) -> LoadedModel | None:
    """A Lightning ``.ckpt``, a DCP checkpoint folder (torchtitan's; an HF Trainer's FSDP
    ``SHARDED_STATE_DICT`` one) or a DeepSpeed ZeRO checkpoint; None for anything else.

    A DeepSpeed ``checkpoint-N`` that also holds an HF ``model.safetensors`` is read from its ZeRO
    shards: they are the fp32 master weights the optimizer trained, whereas the Trainer's
    ``model.safetensors`` is absent (or empty placeholders) under ZeRO-3 without
    ``stage3_gather_16bit_weights_on_model_save``, and otherwise the engine's module weights,
    16-bit under bf16/fp16 training. Name that file (``checkpoint-N/model.safetensors``) to
    report it instead. `trust`: unpickle what needs it (DeepSpeed's shards, a ``.ckpt`` with objects)."""
    if path.is_file() and path.suffix == ".ckpt":
        tensors, tied, note = lightning_tensors(path, embedding, head, trust=trust)
        kind = "lightning"
    elif path.is_dir() and (zero := deepspeed_folder(path)) is not None:
        if need_model:
            raise ReportError(f"--text-file needs a Hugging Face model folder; {path} is a DeepSpeed ZeRO checkpoint "
                              "(its matrices are reported without a text); write one with `python -m "
                              f"deepspeed.utils.zero_to_fp32 {zero[0]} OUT -t {zero[1]} --safe_serialization`, then "
                              "copy config.json and the tokenizer files into OUT")
        tensors, tied, note = zero_tensors(*zero, embedding, head, trust=trust)
        kind, path = "deepspeed", zero[0] / zero[1]
    elif path.is_dir() and (dcp := dcp_folder(path)) is not None:
        tensors, tied, note = dcp_tensors(dcp[0], embedding, head, prefix=dcp[1])
        kind, path = "dcp", dcp[0]
    else:
        return None
    matrices = {role: MatrixSource.of_tensor(role, t) for role, t in tensors.items()}
    return LoadedModel(label, str(path), kind, matrices, tied).add([note])


def load_model(spec: str | os.PathLike | nn.Module | torch.Tensor, *, tensor: Sequence[str] | None = None,
               need_model: bool = False, name: str | None = None, embedding: str | None = None,
               head: str | None = None, trust_checkpoint: bool = False) -> LoadedModel:
    """Resolve one MODEL argument (see the module docstring). Raises `ReportError`.
    trust_checkpoint: allow ``torch.load(weights_only=False)``, which runs the code a pickle holds
    (DeepSpeed ZeRO shards; a Lightning ``.ckpt`` holding objects); refused without it."""
    if isinstance(spec, (torch.Tensor, nn.Module)):
        return _in_memory(spec, name)
    path = Path(spec)
    label = _label(path, name)
    if not path.exists():
        raise ReportError(f"no such file or directory: {path}")
    loaded = _trainer_checkpoint(path, label, embedding, head, need_model, trust_checkpoint)
    if loaded is not None:
        return loaded
    loaded = _safetensors_model(path, label, tensor)
    return loaded if loaded is not None else _hf_model(path, label, need_model)


__all__ = ["LoadedModel", "MatrixSource", "load_model"]
