"""Trainer checkpoints that are not Hugging Face model folders, as report sources: a Lightning
``.ckpt`` file (its ``state_dict``) and a torch.distributed.checkpoint (DCP) folder as
torchtitan writes it (``checkpoint/step-N/`` with ``.metadata`` and ``*.distcp`` shards, FSDP2
shards included: DCP reassembles each tensor). The input embedding and the LM head are found by
their parameter names, or named with ``embedding=`` / ``head=`` (``--embedding`` / ``--head``)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

from aniso_plugins.offline.errors import ReportError
from aniso_plugins.offline.errors import one_line as _one_line

INPUT_NAME = re.compile(r"(^|\.)(embed_tokens|embed|wte|word_embeddings|tok_embeddings|shared)(\.weight)?$")
"""Parameter names of an input embedding (``model.embed.weight``, ``tok_embeddings.weight``, …)."""
OUTPUT_NAME = re.compile(r"(^|\.)(lm_head|output|embed_out)\.weight$")
"""Parameter names of an LM head (``lm_head.weight``, torchtitan's ``output.weight``)."""
_NOT_MODEL = ("optimizer.", "lr_scheduler", "dataloader", "train_state", "aniso")
"""DCP keys of torchtitan's other checkpointed states."""


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


def dcp_folder(path: Path) -> Path | None:
    """The DCP folder of `path`: itself (it holds ``.metadata``), or the newest ``step-N`` of a
    torchtitan checkpoint folder; None if neither."""
    if (path / ".metadata").is_file():
        return path
    steps = [(int(m.group(1)), p) for p in path.glob("step-*") if (m := re.fullmatch(r"step-(\d+)", p.name))
             and (p / ".metadata").is_file()]
    return max(steps)[1] if steps else None


def dcp_tensors(folder: Path, embedding: str | None, head: str | None) -> tuple[dict[str, torch.Tensor], bool | None]:
    """The matrices of a DCP checkpoint folder (one process, no process group), and whether
    the head is tied (equal to the embedding; None when only one of them is there)."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(folder))
    try:
        meta = reader.read_metadata().state_dict_metadata
    except Exception as e:
        raise ReportError(f"cannot read the DCP checkpoint {folder}: {_one_line(e)}") from None
    shapes = {k: (m.size, m.properties.dtype) for k, m in meta.items()
              if isinstance(m, TensorStorageMetadata) and not k.startswith(_NOT_MODEL)}
    picked = _pick(shapes, embedding, head, str(folder))
    out = {role: torch.empty(shapes[key][0], dtype=shapes[key][1]) for role, key in picked.items()}
    try:
        load({picked[role]: t for role, t in out.items()}, storage_reader=reader, no_dist=True)
    except Exception as e:
        raise ReportError(f"cannot read {sorted(picked.values())} from the DCP checkpoint {folder}: {_one_line(e)}") from None
    tied = None if len(out) < 2 else bool(torch.equal(out["embedding"], out["head"]))
    if tied:
        del out["head"]
    return out, tied

__all__ = ["INPUT_NAME", "OUTPUT_NAME", "dcp_folder", "dcp_tensors", "lightning_tensors"]
