"""Trainer checkpoints that are not Hugging Face model folders, as report sources: a Lightning
``.ckpt`` file (its ``state_dict``), a torch.distributed.checkpoint (DCP) folder as torchtitan
writes it (``checkpoint/step-N/`` with ``.metadata`` and ``*.distcp`` shards, FSDP2 shards
included: DCP reassembles each tensor) or as accelerate writes an HF Trainer's FSDP
``SHARDED_STATE_DICT`` (``checkpoint-N/pytorch_model_fsdp_0/``), and a DeepSpeed ZeRO checkpoint
(``checkpoint-N/`` with ``latest`` and ``global_stepN/``), consolidated by DeepSpeed's own
``zero_to_fp32``. The input embedding and the LM head are found by their parameter names, or
named with ``embedding=`` / ``head=`` (``--embedding`` / ``--head``); a low-rank head's factors
(``lm_head.A``, ``lm_head.B``) are found beside where its weight is or would be, and without a
stored weight the head is their product: this module is the one home of that rule and that
product for every format the report reads (HF folders and safetensors files too, in
`aniso_plugins.offline.sources`)."""

from __future__ import annotations

import contextlib
import io
import pickle
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from aniso_plugins.offline.errors import ReportError
from aniso_plugins.offline.errors import one_line as _one_line

HEAD_MODULES = ("lm_head", "output", "embed_out")
"""Module names of an LM head: transformers' ``lm_head``, torchtitan's ``output``, GPT-NeoX's ``embed_out``."""
INPUT_NAME = re.compile(r"(^|\.)(embed_tokens|embed|wte|word_embeddings|tok_embeddings|shared)(\.weight)?$")
"""Parameter names of an input embedding (``model.embed.weight``, ``tok_embeddings.weight``, …)."""
OUTPUT_NAME = re.compile(rf"(^|\.)({'|'.join(HEAD_MODULES)})\.weight$")
"""Parameter names of an LM head (``lm_head.weight``, torchtitan's ``output.weight``)."""
_NOT_MODEL = ("optimizer.", "lr_scheduler", "dataloader", "train_state", "aniso")
"""DCP keys of torchtitan's other checkpointed states."""
_FSDP_MODEL = re.compile(r"pytorch_model_fsdp_\d+")
"""accelerate's sharded FSDP model folder in a Trainer checkpoint (``pytorch_model_fsdp_0``); its
DCP keys are the model's parameter names under ``model.`` (it saves ``{"model": state_dict}``)."""


# --- a low-rank LM head -------------------------------------------------------------------------
# A run trained with ``AnisoConfig(head="lowrank", lowrank_rank=r)`` has the head
# `aniso_plugins.methods.heads.lowrank.LowRankHead`, W = A·B, and its checkpoints hold the module's
# ``A`` (V×r) and ``B`` (r×d), r < d, where a plain model holds its ``weight`` (``lm_head.A``;
# torchtitan's ``output.A``; under a prefix such as Lightning's ``model.lm_head.A``), with or without
# ``weight`` = A·B beside them. The one rule for every format the report reads (`head_factors`,
# `factors_beside`): A and B are ``<module>.A`` and ``<module>.B`` of the module whose
# ``<module>.weight`` the head is or would be (found by name, named by the user, or the model's own
# parameter name); the one product (`low_rank_product`): float64, row block by row block if need be.
_HEAD_MODULE = re.compile(rf"(^|\.)({'|'.join(HEAD_MODULES)})$")

Shapes = Mapping[str, Sequence[int]]
"""Tensor name -> shape, of what a checkpoint holds."""
Rows = Callable[[int, int], torch.Tensor]
"""A matrix's rows start:stop."""


@dataclass(frozen=True)
class LowRankFactors:
    """The names of a low-rank head's factors in a checkpoint: ``a`` (V×r) and ``b`` (r×d), and
    ``weight`` when the checkpoint also holds the module's ``weight`` (then reported as the head,
    the product only checked against it)."""

    a: str
    b: str
    shape: tuple[int, int]
    rank: int
    weight: str | None = None

    def note(self, difference: str | None = None) -> str:
        """What the report says about the head: read as A·B, or (with a stored weight) that the
        weight is A·B, or — `difference`, from `weight_difference` — that it is not."""
        if self.weight is None:
            return f"LM head: low-rank, W = A·B (rank {self.rank}), from {self.a} and {self.b}"
        if difference is None:
            return (f"LM head: low-rank (rank {self.rank}): {self.weight} is reported; it equals A·B of {self.a} "
                    f"and {self.b}")
        return (f"LM head: low-rank (rank {self.rank}): {self.weight} is not A·B of {self.a} and {self.b} "
                f"({difference}); the stored weight is reported")


def _module(name: str) -> str:
    """The module of a head's name: ``x.weight`` (its weight), ``x.A`` / ``x.B`` (a factor) or ``x``."""
    for suffix in (".weight", ".A", ".B"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def factors_beside(shapes: Shapes, head: str, where: str) -> LowRankFactors | None:
    """The factors of the head `head` (its weight's name ``<module>.weight``, the module's name, or
    a factor's): ``<module>.A`` and ``<module>.B`` in `shapes`, with ``<module>.weight`` when that
    is there too; None unless both factors are. Their shapes must chain as a `LowRankHead`'s do
    (A: V×r, B: r×d, 1 <= r < d); where they do not, they are ignored beside a stored weight, and
    refused (`ReportError`, naming `where`) without one: the head could not be read."""
    module = _module(head)
    a, b, weight = f"{module}.A", f"{module}.B", f"{module}.weight"
    if a not in shapes or b not in shapes:
        return None
    sa, sb = tuple(shapes[a]), tuple(shapes[b])
    has_weight = weight in shapes and len(shapes[weight]) == 2
    if not (len(sa) == 2 and len(sb) == 2 and sa[1] == sb[0] and 1 <= sa[1] < sb[1]):
        if has_weight:
            return None
        raise ReportError(f"{where}: {a} {list(sa)} and {b} {list(sb)} are not the factors of a low-rank head "
                          "(A: V×r and B: r×d with r < d); name the matrices to report")
    return LowRankFactors(a, b, (int(sa[0]), int(sb[1])), int(sa[1]), weight if has_weight else None)


def head_factors(shapes: Shapes, head: str | None, where: str) -> tuple[str | None, LowRankFactors | None]:
    """The LM head among `shapes`: the name of its stored 2-D weight (or None) and its low-rank
    factors (or None). `head`: the name given (``--head``): a tensor, or a low-rank head's module
    (``model.lm_head``) or weight name (``model.lm_head.weight``, absent beside ``A`` and ``B``); a
    factor's own name (``lm_head.A``) is that tensor. Without it, the first weight named like a head
    (`OUTPUT_NAME`) and its factors beside it, or else the factors of the first module named like
    one (``lm_head.A`` and ``lm_head.B``)."""
    if head is not None:
        if head in shapes and len(shapes[head]) == 2:
            return head, (None if head.endswith((".A", ".B")) else factors_beside(shapes, head, where))
        return None, factors_beside(shapes, head, where)
    weight = next((k for k in shapes if OUTPUT_NAME.search(k) and len(shapes[k]) == 2), None)
    if weight is not None:
        return weight, factors_beside(shapes, weight, where)
    for key in shapes:
        if key.endswith(".A") and _HEAD_MODULE.search(key[:-2]):
            factors = factors_beside(shapes, key, where)
            if factors is not None:
                return None, factors
    return None, None


def product_dtype(*factors: torch.dtype) -> torch.dtype:
    """The dtype of `low_rank_product`: float64 when the factors are, else float32 (the precision
    the report's geometry reads a matrix's rows in): a 16-bit head's product is not rounded to 16 bits."""
    return torch.float64 if all(f == torch.float64 for f in factors) else torch.float32


def low_rank_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """W = A·B of A (V×r, or a block of its rows: then those rows of W) and B (r×d), computed in
    float64 and returned in `product_dtype`."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"A {list(a.shape)} and B {list(b.shape)} do not chain: expected V×r and r×d")
    return (a.detach().to(torch.float64) @ b.detach().to(torch.float64)).to(product_dtype(a.dtype, b.dtype))


def weight_difference(read_weight: Rows, read_a: Rows, b: torch.Tensor, rows: int,
                      block_rows: int = 4096) -> str | None:
    """None when the stored weight (rows read by `read_weight(start, stop)`) equals A·B (A's rows
    by `read_a`) up to the rounding of the weight's dtype (every entry within max(2·eps, 1e-5) of
    the largest |A·B| entry), else how far it is, in words."""
    worst, scale, eps = 0.0, 0.0, 0.0
    for start in range(0, rows, block_rows):
        stop = min(start + block_rows, rows)
        w = read_weight(start, stop)
        eps = max(eps, torch.finfo(w.dtype).eps)
        p = low_rank_product(read_a(start, stop), b).to(torch.float64)
        worst = max(worst, float((w.to(torch.float64) - p).abs().max()))
        scale = max(scale, float(p.abs().max()))
    if worst <= max(2 * eps, 1e-5) * scale:
        return None
    return f"largest difference {worst:.3g}, the largest |A·B| entry {scale:.3g}"


@dataclass(frozen=True)
class HeadNote:
    """A line the report shows beside a model (``notes`` in report.json, report.md, stderr);
    ``warning``: a stored weight that is not the product of its factors."""

    text: str
    warning: bool = False


def low_rank_head(factors: LowRankFactors, read_a: Rows, b: torch.Tensor,
                  read_weight: Rows | None) -> tuple[Rows | None, HeadNote]:
    """The head of `factors`, given a reader of A's rows, B, and a reader of the stored weight's
    rows when `factors.weight` is there: a reader of A·B's rows (`low_rank_product` of each
    block) and its note; or, beside a stored weight, None (the weight is the head) and the note
    of its check against A·B (a warning when it is not A·B)."""
    if factors.weight is None or read_weight is None:
        product = replace(factors, weight=None)
        return (lambda start, stop: low_rank_product(read_a(start, stop), b)), HeadNote(product.note())
    difference = weight_difference(read_weight, read_a, b, factors.shape[0])
    return None, HeadNote(factors.note(difference), warning=difference is not None)


# --- the checkpoints ------------------------------------------------------------------------------
def _two_d(shapes: Mapping[str, tuple[torch.Size, torch.dtype]]) -> list[str]:
    return [k for k, (s, dt) in shapes.items() if len(s) == 2 and dt.is_floating_point]


def _pick(shapes: Mapping[str, tuple[torch.Size, torch.dtype]], embedding: str | None, head: str | None,
          where: str) -> tuple[dict[str, str], LowRankFactors | None]:
    """{"embedding": key, "head": key} of the stored matrices to report (the head only when it is
    a separate tensor), from the names given or found by `INPUT_NAME` / `OUTPUT_NAME`; and the
    factors of a low-rank head (`head_factors`: its head is their product when it has no "head")."""
    two_d = _two_d(shapes)
    listing = ", ".join(two_d[:12]) or "none"
    head_key, factors = head_factors({k: shapes[k][0] for k in two_d}, head, where)
    for flag, name, found in (("--embedding", embedding, embedding in two_d), ("--head", head, head_key or factors)):
        if name is not None and not found:
            raise ReportError(f"{where} has no 2-D floating-point tensor {name!r} for {flag} (2-D tensors: {listing})")
    picked = {
        "embedding": embedding or next((k for k in two_d if INPUT_NAME.search(k) and "position" not in k), None),
        "head": head_key,
    }
    picked = {k: v for k, v in picked.items() if v is not None}
    if not picked and factors is None:
        raise ReportError(f"{where} has no tensor named like an embedding or an LM head (2-D tensors: {listing}); "
                          "name them with --embedding NAME and --head NAME")
    return picked, factors


def _low_rank(out: dict[str, torch.Tensor], factors: LowRankFactors | None,
              tensor: Callable[[str], torch.Tensor]) -> HeadNote | None:
    """Put a low-rank head into `out` (the matrices read, by role): A·B as the head, or, beside a
    stored weight (``out["head"]``), that weight checked against it; its note. `tensor`: a
    factor's values by name."""
    if factors is None:
        return None
    a, b = tensor(factors.a), tensor(factors.b)
    stored = out.get("head")
    read, note = low_rank_head(factors, lambda i, j: a[i:j], b, None if stored is None else lambda i, j: stored[i:j])
    if read is not None:
        out["head"] = read(0, factors.shape[0])
    return note


Matrices = tuple[dict[str, torch.Tensor], bool | None, HeadNote | None]
"""What a checkpoint gives the report: its matrices by role (``embedding``, ``head``), whether the
head is tied to the embedding (None when only one of them is there), and the note of a low-rank
head (None for an ordinary one)."""


UNTRUSTED = ("pass --trust-checkpoint (trust_checkpoint=True in Python) only if you trust where it came from, "
             "since loading a pickle runs any code it holds")
"""The end of every refusal to unpickle a checkpoint: the flag that allows it, and why it is asked for."""


def untrusted_pickle(path: Path, what: str, safe_route: str) -> ReportError:
    """The one-line refusal to read `path`, whose `what` needs ``torch.load(weights_only=False)``,
    naming the flag and `safe_route`, a way to a weights-only file without this tool."""
    return ReportError(f"{path}: {what}; {UNTRUSTED}, or {safe_route}")


def lightning_tensors(path: Path, embedding: str | None, head: str | None, *, trust: bool = False) -> Matrices:
    """The matrices of a Lightning ``.ckpt``; the head is tied when it has the same storage as
    the embedding. Read with ``torch.load(weights_only=True, mmap=True)``: no code runs. A
    checkpoint holding other objects (hyperparameters of a custom class) is unpickled with
    ``weights_only=False`` only when `trust` is set."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        if not trust:
            found = re.search(r"GLOBAL ([\w.]+)", str(e))
            raise untrusted_pickle(path, "this Lightning checkpoint holds objects other than tensors"
                                   + (f" ({found.group(1)})" if found else ""),
                                   "save its ckpt['state_dict'] with safetensors.torch.save_file in the program that "
                                   "wrote it and report that file") from None
        ckpt = _load_pickle(path, "the Lightning checkpoint")
    except Exception as e:
        raise ReportError(f"cannot read the Lightning checkpoint {path}: {_one_line(e)}") from None
    state = ckpt.get("state_dict") if isinstance(ckpt, dict) else None
    if not isinstance(state, dict):
        raise ReportError(f"{path} is not a Lightning checkpoint: no 'state_dict' in it")
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    picked, factors = _pick({k: (v.shape, v.dtype) for k, v in tensors.items()}, embedding, head, str(path))
    out = {role: tensors[key] for role, key in picked.items()}
    tied = "embedding" in out and "head" in out and out["head"].data_ptr() == out["embedding"].data_ptr()
    if tied:
        del out["head"]
    note = None if tied else _low_rank(out, factors, tensors.__getitem__)
    return out, tied, note


def dcp_folder(path: Path) -> tuple[Path, str] | None:
    """The DCP folder of `path` and the prefix of its model's keys: itself (it holds
    ``.metadata``), the newest ``step-N`` of a torchtitan checkpoint folder, or the
    ``pytorch_model_fsdp_0`` of an HF Trainer ``checkpoint-N`` (prefix ``model.``); None if none."""
    if (path / ".metadata").is_file():
        return path, "model." if _FSDP_MODEL.fullmatch(path.name) else ""
    if (path / "pytorch_model_fsdp_0" / ".metadata").is_file():
        return path / "pytorch_model_fsdp_0", "model."
    steps = [(int(m.group(1)), p) for p in path.glob("step-*") if (m := re.fullmatch(r"step-(\d+)", p.name))
             and (p / ".metadata").is_file()]
    return (max(steps)[1], "") if steps else None


def dcp_tensors(folder: Path, embedding: str | None, head: str | None, prefix: str = "") -> Matrices:
    """The matrices of a DCP checkpoint folder (one process, no process group); the head is
    tied when it equals the embedding. `prefix`: what the model's keys start with (names are given
    and listed without it)."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(folder))
    try:
        meta = reader.read_metadata().state_dict_metadata
    except Exception as e:
        raise ReportError(f"cannot read the DCP checkpoint {folder}: {_one_line(e)}") from None
    shapes = {k.removeprefix(prefix): (m.size, m.properties.dtype) for k, m in meta.items()
              if isinstance(m, TensorStorageMetadata) and k.startswith(prefix) and not k.startswith(_NOT_MODEL)}
    picked, factors = _pick(shapes, embedding, head, str(folder))
    keys = {*picked.values(), *((factors.a, factors.b) if factors is not None else ())}
    read = {key: torch.empty(shapes[key][0], dtype=shapes[key][1]) for key in keys}
    try:
        load({prefix + key: t for key, t in read.items()}, storage_reader=reader, no_dist=True)
    except Exception as e:
        raise ReportError(f"cannot read {sorted(keys)} from the DCP checkpoint {folder}: {_one_line(e)}") from None
    out = {role: read[key] for role, key in picked.items()}
    note = _low_rank(out, factors, read.__getitem__)
    tied = None if len(out) < 2 else note is None and bool(torch.equal(out["embedding"], out["head"]))
    if tied:
        del out["head"]
    return out, tied, note


def deepspeed_folder(path: Path) -> tuple[Path, str] | None:
    """The checkpoint folder and tag of a DeepSpeed checkpoint at `path`: a ``global_stepN``
    folder holding ZeRO shards (``*_model_states.pt``, ``*_optim_states.pt``), or an HF Trainer
    ``checkpoint-N`` whose ``latest`` file names it; None if neither."""
    if any(path.glob("*_model_states.pt")) or any(path.glob("*_optim_states.pt")):
        return path.parent, path.name
    tags = sorted(p.name for p in path.glob("global_step*") if p.is_dir())
    if not (path / "latest").is_file():
        if tags:
            raise ReportError(f"{path} is a DeepSpeed checkpoint without its 'latest' file naming the step to read "
                              f"({', '.join(tags)}); pass that global_stepN folder itself")
        return None
    tag = (path / "latest").read_text().strip()
    if not (path / tag).is_dir():
        raise ReportError(f"the DeepSpeed checkpoint {path} is incomplete: its 'latest' file names {tag!r}, "
                          f"but there is no {path / tag} (folders: {', '.join(tags) or 'none'})")
    return path, tag


def _load_pickle(path: Path, what: str) -> Any:
    """``torch.load(path, weights_only=False)``: for a checkpoint the user said they trust."""
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as e:
        raise ReportError(f"cannot read {what} {path}: {_one_line(e)}") from None


def _zero_missing(tag_dir: Path) -> list[str]:
    """The shard files that DeepSpeed needs and `tag_dir` lacks: a model states file, and the
    optimizer shard of every rank its first shard's partition count says there were."""
    missing = [] if any(tag_dir.glob("*_model_states.pt")) else ["*_model_states.pt"]
    optim = sorted(tag_dir.glob("*_optim_states.pt"))
    if not optim:
        return [*missing, "*_optim_states.pt"]
    try:
        count = _load_pickle(optim[0], "the ZeRO shard")["optimizer_state_dict"]["partition_count"]
    except Exception:
        return missing
    world = max(count) if isinstance(count, (list, tuple)) else int(count)
    names = (re.sub(r"zero_pp_rank_\d+_", f"zero_pp_rank_{r}_", optim[0].name) for r in range(world))
    return missing + [n for n in names if not (tag_dir / n).is_file()]


def _zero_state(folder: Path, tag: str) -> dict[str, Any]:
    """DeepSpeed's lazy fp32 state dict of the ZeRO shards in ``folder/tag``
    (``get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True)``), its prints kept off stdout."""
    where = folder / tag
    try:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's logger writes to the sys.stdout of its import
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError:
        raise ReportError(f"{where} is a DeepSpeed ZeRO checkpoint; reading it needs deepspeed "
                          "(pip install deepspeed)") from None
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag, lazy_mode=True)
    except Exception as e:
        missing = _zero_missing(where)
        if missing:
            raise ReportError(f"the DeepSpeed checkpoint {where} is incomplete: no {', '.join(missing)} "
                              "(every rank's ZeRO shards are needed)") from None
        raise ReportError(f"cannot consolidate the DeepSpeed checkpoint {where}: {_one_line(e)}") from None


def zero_tensors(folder: Path, tag: str, embedding: str | None, head: str | None, *,
                 trust: bool = False) -> Matrices:
    """The matrices of a DeepSpeed ZeRO (stage 1-3) checkpoint, ``folder/tag``, consolidated
    from every rank's fp32 master-weight partitions by DeepSpeed's own code (lazily: under ZeRO-3
    only these two, or the embedding and a low-rank head's factors, are assembled); the head is
    tied when DeepSpeed records it as a parameter shared with the embedding. The shards are pickles
    that DeepSpeed loads with ``weights_only=False``: refused unless `trust` is set."""
    if not trust:
        raise untrusted_pickle(folder / tag, "a DeepSpeed ZeRO checkpoint's shards are pickles",
                               f"convert it with `python -m deepspeed.utils.zero_to_fp32 {folder} OUT -t {tag} "
                               "--safe_serialization` and report OUT")
    state = _zero_state(folder, tag)
    picked, factors = _pick({k: (v.shape, v.dtype) for k, v in state.items()}, embedding, head, str(folder / tag))
    tied = None if len(picked) < 2 else factors is None and state[picked["head"]] is state[picked["embedding"]]
    if tied:
        del picked["head"]

    def tensor(key: str) -> torch.Tensor:  # cloned: under ZeRO-1/2 the tensors are views of the model's fp32 buffer
        return state[key].contiguous().clone()

    out = {role: tensor(key) for role, key in picked.items()}
    note = _low_rank(out, factors, tensor)
    if tied is None and len(out) == 2:
        tied = False
    return out, tied, note


__all__ = ["HEAD_MODULES", "INPUT_NAME", "OUTPUT_NAME", "UNTRUSTED", "HeadNote", "LowRankFactors", "dcp_folder",
           "dcp_tensors", "deepspeed_folder", "factors_beside", "head_factors", "lightning_tensors", "low_rank_head",
           "low_rank_product", "product_dtype", "untrusted_pickle", "weight_difference", "zero_tensors"]
