"""Plugin state on disk: one safetensors file with a small JSON header.

Layout: tensors named ``<plugin>/<key>``; safetensors metadata holds ``format``
("aniso_plugins.core.state"), ``version`` (of the file format), ``package`` (aniso_plugins version)
and ``config`` (the `AnisoConfig` as JSON). A file written under another format version or
another training configuration is refused with a message that names the difference, because
counters and fitted transforms are only meaningful for the configuration that made them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch
from safetensors.torch import load_file, save_file

from aniso_plugins.core.config import AnisoConfig
from aniso_plugins.core.errors import StateError
from aniso_plugins.core.version import __version__

FORMAT = "aniso_plugins.core.state"
FORMAT_VERSION = 1
RESET_HINT = "to resume without it, delete it or set AnisoConfig(on_state_mismatch='reset') to start the plugins' state fresh"


def save_state(path: str | os.PathLike, state: Mapping[str, Mapping[str, torch.Tensor]], config: Mapping) -> None:
    """Write ``{plugin: {key: tensor}}`` to `path` atomically (temp file + rename)."""
    tensors = {}
    for plugin, entries in state.items():
        for key, value in entries.items():
            if "/" in plugin:
                raise ValueError(f"plugin name {plugin!r} must not contain '/'")
            tensors[f"{plugin}/{key}"] = value.detach().contiguous().cpu()
    meta = {
        "format": FORMAT,
        "version": str(FORMAT_VERSION),
        "package": __version__,
        "config": json.dumps(dict(config), sort_keys=True),
        "plugins": json.dumps(sorted(state)),
    }
    path = os.fspath(path)
    tmp = f"{path}{TEMP_SUFFIX}{os.getpid()}"
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, path)


TEMP_SUFFIX = ".tmp"


def remove_stale_temporaries(path: str | os.PathLike) -> list[str]:
    """Delete ``<path>.tmp<pid>`` files that a save killed before its rename left behind
    (call where no other process is saving to `path`); returns what it deleted."""
    path = os.fspath(path)
    folder, name = os.path.split(path)
    stale = [
        os.path.join(folder, f) for f in os.listdir(folder or ".") if f.startswith(name + TEMP_SUFFIX)
    ] if os.path.isdir(folder or ".") else []
    for f in stale:
        os.remove(f)
    return stale


def load_state(path: str | os.PathLike, config: Mapping) -> dict[str, dict[str, torch.Tensor]]:
    """Read a file written by `save_state` and check it against `config`.

    Raises `StateError` if the file is not ours, has another format version, or was written
    under a configuration that differs in any of its state fields (`AnisoConfig.state_fields`)."""
    from safetensors import safe_open

    path = os.fspath(path)
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(path)
        saved_config = json.loads(meta.get("config", "{}"))
        plugins = json.loads(meta.get("plugins", "[]"))
    except Exception as e:  # safetensors' errors, OSError, JSON errors: all mean "cannot read it"
        raise StateError(
            f"{path}: not a readable aniso_plugins state file ({type(e).__name__}: {e}); it is truncated, empty "
            f"or corrupt (e.g. a save interrupted by a kill): {RESET_HINT}, or resume from an older checkpoint"
        ) from e
    if meta.get("format") != FORMAT:
        raise StateError(f"{path}: not an aniso_plugins state file (format={meta.get('format')!r}): {RESET_HINT}")
    if meta.get("version") != str(FORMAT_VERSION):
        raise StateError(
            f"{path}: state format version {meta.get('version')} (package {meta.get('package')}), "
            f"this package reads version {FORMAT_VERSION}: {RESET_HINT}"
        )
    check_compatible(saved_config, config, path)
    state: dict[str, dict[str, torch.Tensor]] = {p: {} for p in plugins}
    for name, tensor in tensors.items():
        plugin, sep, key = name.partition("/")
        if not sep:
            raise StateError(f"{path}: tensor {name!r} is not named <plugin>/<key>: {RESET_HINT}")
        state.setdefault(plugin, {})[key] = tensor
    return state


def check_compatible(saved: Mapping, config: Mapping, where: str) -> None:
    """Raise `StateError` if state saved under `saved` is meaningless under `config`
    (they differ in one of the fields whose change makes saved state meaningless,
    `AnisoConfig.state_fields`: each feature's `STATE_FIELDS`; the rest, e.g. metric cadence,
    may change on resume, and AGG's window is not among them: the token counter re-cuts its
    window itself where that is exact)."""
    if isinstance(saved.get("method"), str):  # written before method became a list (0.1: "agg")
        saved = {**saved, "method": [saved["method"]]}
    # a feature's STATE_DEFAULTS: {field: the value its None stands for}, so None and that value compare equal
    defaults = {k: v for c in AnisoConfig.option_classes() for k, v in vars(c).get("STATE_DEFAULTS", {}).items()}
    was = {k: _jsonable(saved.get(k, None)) for k in AnisoConfig.state_fields()}
    now = {k: _jsonable(config.get(k)) for k in AnisoConfig.state_fields()}
    for values in (was, now):
        values.update({k: defaults[k] for k, v in values.items() if v is None and k in defaults})
    diffs = [f"{k}: saved {was[k]!r}, now {now[k]!r}" for k in AnisoConfig.state_fields() if was[k] != now[k]]
    if diffs:
        raise StateError(f"{where}: written under another configuration ({'; '.join(diffs)}): {RESET_HINT}")


def _jsonable(value):
    return json.loads(json.dumps(value))


__all__ = ["FORMAT_VERSION", "StateError", "check_compatible", "load_state", "remove_stale_temporaries", "save_state"]
