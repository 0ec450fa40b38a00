"""Trainer checkpoints that are not Hugging Face model folders, as report sources: a Lightning
``.ckpt`` file (its ``state_dict``), a torch.distributed.checkpoint (DCP) folder as torchtitan
writes it (``checkpoint/step-N/`` with ``.metadata`` and ``*.distcp`` shards, FSDP2 shards
included: DCP reassembles each tensor) or as accelerate writes an HF Trainer's FSDP
``SHARDED_STATE_DICT`` (``checkpoint-N/pytorch_model_fsdp_0/``), and a DeepSpeed ZeRO checkpoint
(``checkpoint-N/`` with ``latest`` and ``global_stepN/``), consolidated by DeepSpeed's own
``zero_to_fp32``. The input embedding and the LM head are found by their parameter names, or
named with ``embedding=`` / ``head=`` (``--embedding`` / ``--head``)."""

from __future__ import annotations

import contextlib
import io
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from aniso_plugins.offline.errors import ReportError
from aniso_plugins.offline.errors import one_line as _one_line

INPUT_NAME = re.compile(r"(^|\.)(embed_tokens|embed|wte|word_embeddings|tok_embeddings|shared)(\.weight)?$")
"""Parameter names of an input embedding (``model.embed.weight``, ``tok_embeddings.weight``, …)."""
OUTPUT_NAME = re.compile(r"(^|\.)(lm_head|output|embed_out)\.weight$")
"""Parameter names of an LM head (``lm_head.weight``, torchtitan's ``output.weight``)."""
_NOT_MODEL = ("optimizer.", "lr_scheduler", "dataloader", "train_state", "aniso")
"""DCP keys of torchtitan's other checkpointed states."""
_FSDP_MODEL = re.compile(r"pytorch_model_fsdp_\d+")
"""accelerate's sharded FSDP model folder in a Trainer checkpoint (``pytorch_model_fsdp_0``); its
DCP keys are the model's parameter names under ``model.`` (it saves ``{"model": state_dict}``)."""


def _two_d(shapes: Mapping[str, tuple[torch.Size, torch.dtype]]) -> list[str]:
    return [k for k, (s, dt) in shapes.items() if len(s) == 2 and dt.is_floating_point]


def _pick(shapes: Mapping[str, tuple[torch.Size, torch.dtype]], embedding: str | None, head: str | None,
          where: str) -> dict[str, str]:
    """{"embedding": key, "head": key} of the matrices to report (the head only when it is a
    separate tensor), from the names given or found by `INPUT_NAME` / `OUTPUT_NAME`."""
    two_d = _two_d(shapes)
    listing = ", ".join(two_d[:12]) or "none"
    for flag, name in (("--embedding", embedding), ("--head", head)):
        if name is not None and name not in two_d:
            raise ReportError(f"{where} has no 2-D floating-point tensor {name!r} for {flag} (2-D tensors: {listing})")
    picked = {
        "embedding": embedding or next((k for k in two_d if INPUT_NAME.search(k) and "position" not in k), None),
        "head": head or next((k for k in two_d if OUTPUT_NAME.search(k)), None),
    }
    picked = {k: v for k, v in picked.items() if v is not None}
    if not picked:
        raise ReportError(f"{where} has no tensor named like an embedding or an LM head (2-D tensors: {listing}); "
                          "name them with --embedding NAME and --head NAME")
    return picked


def lightning_tensors(path: Path, embedding: str | None, head: str | None) -> tuple[dict[str, torch.Tensor], bool]:
    """The matrices of a Lightning ``.ckpt`` and whether the head is tied (the same storage
    as the embedding). Read with ``torch.load(weights_only=True, mmap=True)``: no code runs."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise ReportError(f"cannot read the Lightning checkpoint {path}: {_one_line(e)}") from None
    state = ckpt.get("state_dict") if isinstance(ckpt, dict) else None
    if not isinstance(state, dict):
        raise ReportError(f"{path} is not a Lightning checkpoint: no 'state_dict' in it")
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    picked = _pick({k: (v.shape, v.dtype) for k, v in tensors.items()}, embedding, head, str(path))
    out = {role: tensors[key] for role, key in picked.items()}
    tied = "embedding" in out and "head" in out and out["head"].data_ptr() == out["embedding"].data_ptr()
    if tied:
        del out["head"]
    return out, tied


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


def dcp_tensors(folder: Path, embedding: str | None, head: str | None,
                prefix: str = "") -> tuple[dict[str, torch.Tensor], bool | None]:
    """The matrices of a DCP checkpoint folder (one process, no process group), and whether
    the head is tied (equal to the embedding; None when only one of them is there). `prefix`:
    what the model's keys start with (names are given and listed without it)."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(folder))
    try:
        meta = reader.read_metadata().state_dict_metadata
    except Exception as e:
        raise ReportError(f"cannot read the DCP checkpoint {folder}: {_one_line(e)}") from None
    shapes = {k.removeprefix(prefix): (m.size, m.properties.dtype) for k, m in meta.items()
              if isinstance(m, TensorStorageMetadata) and k.startswith(prefix) and not k.startswith(_NOT_MODEL)}
    picked = _pick(shapes, embedding, head, str(folder))
    out = {role: torch.empty(shapes[key][0], dtype=shapes[key][1]) for role, key in picked.items()}
    try:
        load({prefix + picked[role]: t for role, t in out.items()}, storage_reader=reader, no_dist=True)
    except Exception as e:
        raise ReportError(f"cannot read {sorted(picked.values())} from the DCP checkpoint {folder}: {_one_line(e)}") from None
    tied = None if len(out) < 2 else bool(torch.equal(out["embedding"], out["head"]))
    if tied:
        del out["head"]
    return out, tied


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


def _zero_missing(tag_dir: Path) -> list[str]:
    """The shard files that DeepSpeed needs and `tag_dir` lacks: a model states file, and the
    optimizer shard of every rank its first shard's partition count says there were."""
    missing = [] if any(tag_dir.glob("*_model_states.pt")) else ["*_model_states.pt"]
    optim = sorted(tag_dir.glob("*_optim_states.pt"))
    if not optim:
        return [*missing, "*_optim_states.pt"]
    try:
        state = torch.load(optim[0], map_location="cpu", mmap=True, weights_only=False)["optimizer_state_dict"]
        count = state["partition_count"]
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


def zero_tensors(folder: Path, tag: str, embedding: str | None,
                 head: str | None) -> tuple[dict[str, torch.Tensor], bool | None]:
    """The matrices of a DeepSpeed ZeRO (stage 1-3) checkpoint, ``folder/tag``, consolidated
    from every rank's fp32 master-weight partitions by DeepSpeed's own code (lazily: under ZeRO-3
    only these two are assembled), and whether the head is tied (a parameter DeepSpeed records as
    shared with the embedding; None when only one of them is there). The shards are pickles:
    DeepSpeed loads them with ``weights_only=False``, so read only checkpoints you trust."""
    state = _zero_state(folder, tag)
    picked = _pick({k: (v.shape, v.dtype) for k, v in state.items()}, embedding, head, str(folder / tag))
    tied = None if len(picked) < 2 else state[picked["head"]] is state[picked["embedding"]]
    if tied:
        del picked["head"]
    # cloned: under ZeRO-1/2 the tensors are views of the whole model's fp32 buffer
    return {role: state[key].contiguous().clone() for role, key in picked.items()}, tied


__all__ = ["INPUT_NAME", "OUTPUT_NAME", "dcp_folder", "dcp_tensors", "deepspeed_folder", "lightning_tensors",
           "zero_tensors"]
