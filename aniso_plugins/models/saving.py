"""``save_pretrained`` of a transformers model when it is handed the state dict to write
(``save_pretrained(dir, state_dict=...)``): the HF Trainer does so under DeepSpeed ZeRO-3 (the
engine's consolidated weights, built parameter by parameter without ``Module.state_dict()``) and
FSDP (its full state dict). What a module adds to its own state dict in ``_save_to_state_dict``
(a low-rank head's ``weight`` = A·B) is then missing; `CompletedSavePretrained`, set on the model
instance, adds it. Duck-typed: transformers is not imported."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Completion = Callable[[dict[str, torch.Tensor], str], object]
"""``complete(state_dict, prefix)``: fills in the keys of the module at `prefix` (its path, with the dot)."""


class CompletedSavePretrained:
    """The model's ``save_pretrained``, with the state dict it is handed (``state_dict=``, by
    keyword or position) copied and completed by each ``(complete, prefix)`` of `completions`
    before the save; a call without one goes through unchanged (``Module.state_dict()`` runs the
    modules' own code). An object rather than a closure, so that ``copy.deepcopy(model)`` gives the
    copy a ``save_pretrained`` of its own (the model and the completions' modules are copied with
    it) and the model still pickles."""

    def __init__(self, model: nn.Module, completions: list[tuple[Completion, str]], own: Any = None) -> None:
        self.model = model
        self.completions = completions
        self.own = own
        """An instance ``save_pretrained`` the model had before (called instead of the class's)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        save = self.own if self.own is not None else type(self.model).save_pretrained.__get__(self.model)
        bound = inspect.signature(save).bind(*args, **kwargs)
        state_dict = bound.arguments.get("state_dict")
        if state_dict is not None:
            state_dict = dict(state_dict)
            for complete, prefix in self.completions:
                complete(state_dict, prefix)
            bound.arguments["state_dict"] = state_dict
        return save(*bound.args, **bound.kwargs)


def complete_save_pretrained(model: nn.Module, complete: Completion, prefix: str) -> Callable[[], None] | None:
    """Have ``model.save_pretrained(..., state_dict=given)`` apply ``complete(given, prefix)``
    first (one `CompletedSavePretrained` per model, the completions in the order added); returns
    the function that undoes it, or None where the model has no ``save_pretrained``."""
    if not callable(getattr(type(model), "save_pretrained", None)):
        return None
    installed = model.__dict__.get("save_pretrained")
    if not isinstance(installed, CompletedSavePretrained):
        installed = CompletedSavePretrained(model, [], own=installed)
        model.__dict__["save_pretrained"] = installed
    entry = (complete, prefix)
    installed.completions.append(entry)

    def undo() -> None:
        if entry in installed.completions:
            installed.completions.remove(entry)
        if not installed.completions and model.__dict__.get("save_pretrained") is installed:
            if installed.own is None:
                del model.__dict__["save_pretrained"]
            else:
                model.__dict__["save_pretrained"] = installed.own

    return undo


__all__ = ["CompletedSavePretrained", "Completion", "complete_save_pretrained"]
