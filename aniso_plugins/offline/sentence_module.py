"""A fitted post-processing transform as a sentence-transformers module (needs the optional
``sentence-transformers`` package): appended after the Pooling module of a sentence-transformers
model folder, ``SentenceTransformer(folder).encode(...)`` returns the transformed vectors."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from sentence_transformers.base.modules import Module

from aniso_plugins.offline.transform_base import Transform

FILE = "transform.safetensors"


class AnisoTransform(Module):
    """``features["sentence_embedding"]`` ↦ ``transform.transform(...)`` (`Transform`)."""

    def __init__(self, transform: Transform) -> None:
        super().__init__()
        self.transform = transform

    def forward(self, features: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        x = features["sentence_embedding"]
        features["sentence_embedding"] = self.transform.transform(x).to(x.dtype)
        return features

    def save(self, output_path: str, *args: Any, safe_serialization: bool = True, **kwargs: Any) -> None:
        self.transform.save(os.path.join(output_path, FILE))

    @classmethod
    def load(cls, model_name_or_path: str, subfolder: str = "", **kwargs: Any) -> AnisoTransform:
        keys = ("token", "cache_folder", "revision", "local_files_only")
        path = cls.load_file_path(model_name_or_path, FILE, subfolder=subfolder, **{k: kwargs[k] for k in keys if k in kwargs})
        return cls(Transform.load(path))


def with_transform(model_folder: Path, transform: Transform, out: Path) -> Path:
    """A copy of the sentence-transformers model folder `model_folder` in `out` with
    `transform` appended as the last module (``modules.json``); returns `out`."""
    shutil.copytree(model_folder, out)
    modules = json.loads((out / "modules.json").read_text())
    idx = max(int(m["idx"]) for m in modules) + 1
    name = f"{idx}_AnisoTransform"
    (out / name).mkdir()
    AnisoTransform(transform).save(str(out / name))
    modules.append({"idx": idx, "name": str(idx), "path": name, "type": f"{__name__}.AnisoTransform"})
    (out / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    return out


__all__ = ["AnisoTransform", "with_transform"]
