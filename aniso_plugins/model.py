"""How plugins reach the parts of a model they act on: the LM head, the input embedding, the
transformer blocks. Adapters build a `ModelHandle` for their trainer's model; plugins never
guess attribute names themselves."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn


class SetupError(RuntimeError):
    """The model cannot be set up for the configured method (raised before any step runs)."""


def _get(root: nn.Module, path: str) -> nn.Module:
    try:
        return root.get_submodule(path)
    except AttributeError as e:
        raise SetupError(f"{type(root).__name__} has no submodule {path!r}: {e}") from None


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(_get(root, parent) if parent else root, name, module)


class ModelHandle:
    """Access to a causal LM's head, input embedding and blocks by submodule path.

    head: path of the output projection (an ``nn.Linear``-like module with ``weight`` of
        shape (V, d)); input_embedding: path of the token embedding or None; blocks: path of
        the ``nn.ModuleList`` of transformer blocks or None. Subclasses (the HF adapter's)
        override the accessors; `untie` calls `on_untie` so the framework does not re-tie."""

    def __init__(
        self,
        model: nn.Module,
        *,
        head: str = "lm_head",
        input_embedding: str | None = None,
        blocks: str | None = None,
        on_untie: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        self._head = head
        self._embedding = input_embedding
        self._blocks = blocks
        self._on_untie = on_untie
        head_module = self.head()
        weight = getattr(head_module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise SetupError(
                f"the LM head {type(head_module).__name__} at {head!r} has no 2-D `weight`; "
                "expected an nn.Linear-like output projection of shape (vocab, hidden)"
            )

    def head(self) -> nn.Module:
        """The output projection module (owns ``weight``, shape (V, d))."""
        return _get(self.model, self._head)

    def set_head(self, module: nn.Module) -> None:
        """Replace the output projection (before the model is wrapped by DDP/FSDP)."""
        _set(self.model, self._head, module)

    def input_embedding(self) -> nn.Module | None:
        """The token embedding, or None if the model has none reachable."""
        return _get(self.model, self._embedding) if self._embedding else None

    def blocks(self) -> Sequence[nn.Module]:
        """The transformer blocks, in order (empty if unknown)."""
        return list(_get(self.model, self._blocks)) if self._blocks else []

    @property
    def vocab_size(self) -> int:
        return self.head().weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.head().weight.shape[1]

    def tied(self) -> bool:
        """True when the head and the input embedding share one weight Parameter."""
        emb = self.input_embedding()
        return emb is not None and getattr(emb, "weight", None) is self.head().weight

    def untie(self) -> None:
        """Give the head an independent copy of the shared weight (no-op when not tied)."""
        if not self.tied():
            return
        head = self.head()
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
        if self._on_untie is not None:
            self._on_untie()


__all__ = ["ModelHandle", "SetupError"]
