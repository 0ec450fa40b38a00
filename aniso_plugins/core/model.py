"""How plugins reach the parts of a model they act on: the LM head, the input embedding, the
transformer blocks. Adapters build a `ModelHandle` for their trainer's model; plugins never
guess attribute names themselves. Where a transformers model keeps them (and PEFT's wrappers of
them) is `aniso_plugins.models.handle.OutputEmbeddingsHandle`, a subclass.

The handle is also the journal of what set-up did to the model: `set_head`, `untie` and every
change a plugin registers with `on_restore` (a forward installed in place, a hook) are undone,
newest first, by `restore`. The session calls it when a set-up fails half-way (nothing stays
half-applied) and on `detach` (the model is again exactly what it was: same modules, same
Parameters, same tying, same forwards)."""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from aniso_plugins.core.errors import SetupError
from aniso_plugins.core.layout import ParallelLayout
from aniso_plugins.numerics.distributed import VocabShard, vocab_shard_rows
from aniso_plugins.numerics.gathered import full_shape, gathered

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from aniso_plugins.methods.fused_loss.logit_transform import LogitTransform


def _get(root: nn.Module, path: str) -> nn.Module:
    try:
        return root.get_submodule(path)
    except AttributeError as e:
        raise SetupError(f"{type(root).__name__} has no submodule {path!r}: {e}") from None


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(_get(root, parent) if parent else root, name, module)


_HANDLES: weakref.WeakKeyDictionary[nn.Module, list[ModelHandle]] = weakref.WeakKeyDictionary()
"""Per model, the handles whose journal holds changes to it (what `detach` undoes)."""



def guard_module_hooks() -> None:
    """Make ``torch.compile`` notice the hooks a session adds to and removes from the model.

    dynamo skips guards on ``nn.Module`` hooks by default (``torch._dynamo.config.
    skip_nnmodule_hook_guards``): a forward compiled before a hook was added, or after one was
    removed, runs as it was traced, so a loss term or measurement hook that is added at set-up or at
    a measurement step would be silently ignored (or a removed one still run) under compilation. The
    session turns those guards on for the process; where they were off, graphs compiled so far
    (without them) are discarded once (``torch._dynamo.reset``) so that none is reused unguarded."""
    import torch._dynamo

    if torch._dynamo.config.skip_nnmodule_hook_guards:
        torch._dynamo.config.skip_nnmodule_hook_guards = False
        torch._dynamo.reset()
        logging.getLogger("aniso_plugins").info("aniso: torch.compile now guards on module hooks (skip_nnmodule_hook_guards=False)")

class ModelHandle:
    """Access to a causal LM's head, input embedding and blocks by submodule path.

    ``framework_wraps_head_forward``: the trainer sets an instance ``forward`` on the head
    around its class forward that changes no value (torchtitan's), so a forward installed in
    place over it is not replacing user code.

    head: path of the output projection (an ``nn.Linear``-like module with ``weight`` of
        shape (V, d)); input_embedding: path of the token embedding or None; blocks: path of
        the ``nn.ModuleList`` of transformer blocks or None. Subclasses (`OutputEmbeddingsHandle`)
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
        self._undo: list[tuple[Callable[[], None], bool]] = []  # (undo, is head surgery)
        head_module = self.head()
        weight = getattr(head_module, "weight", None)
        if not isinstance(weight, torch.Tensor) or len(full_shape(weight)) != 2:
            raise SetupError(
                f"the LM head {type(head_module).__name__} at {head!r} has no 2-D `weight`; "
                "expected an nn.Linear-like output projection of shape (vocab, hidden)"
            )
        self._head_shape = tuple(full_shape(weight))
        embedding = getattr(self.input_embedding(), "weight", None)
        embedding_shape = tuple(full_shape(embedding)) if isinstance(embedding, torch.Tensor) else ()
        if len(embedding_shape) == 2 and self._head_shape != embedding_shape:
            if self._head_shape == embedding_shape[::-1]:
                raise SetupError(
                    f"the LM head {type(head_module).__name__} stores its weight as {self._head_shape}, the transpose "
                    f"of the input embedding's {embedding_shape} (vocab, hidden): aniso_plugins reads the head's "
                    "rows as token vectors, so the weight must be (vocab, hidden) as in nn.Linear(hidden, vocab)"
                )

    framework_wraps_head_forward: bool = False
    head_skips_label: int | None = None
    """The label whose positions the head does not run on: the model compacts its head's input
    to the rows of the other labels, in order (ModernBERT's ``sparse_prediction``), and the
    session hands the plugins those rows' targets; None: the head runs on every position."""
    layout: ParallelLayout = ParallelLayout()
    """The run's parallel layout (`aniso_plugins.core.layout.ParallelLayout`), given by the
    session at set-up; its meshes below are what the plugins read of it."""

    @property
    def vocab_mesh(self) -> DeviceMesh | None:
        """The layout's vocabulary mesh: its ranks each hold a ``torch.chunk`` shard of the
        head's weight inside its forward (a rank's logits are its shard's); None: all V rows."""
        return self.layout.vocab_mesh

    @property
    def sequence_mesh(self) -> DeviceMesh | None:
        """The layout's sequence mesh: its ranks each hold a ``torch.chunk`` of the positions at
        the blocks' outputs; None: a rank's block outputs cover its whole micro-batch."""
        return self.layout.sequence_mesh

    @property
    def backward_runs_twice(self) -> bool:
        """Whether the trainer runs the backward of one forward twice (the layout's); the fused
        loss then keeps its gradients for the second one."""
        return self.layout.backward_runs_twice

    logit_transform: LogitTransform | None = None
    """The elementwise soft-cap or scale the model applies to the head's output before its loss
    (Gemma 2/3, Cohere, Granite, Falcon-H1; set by the adapter that reads it from the model): the
    fused loss applies it chunk by chunk; None: the head's output is the logits."""
    engine_root: nn.Module | None = None
    """The trainer's outermost wrapper of the model once its engine has wrapped it (FSDP1's root
    ``FullyShardedDataParallel``), under which `full_weights` finds the units that hold the head
    and the embedding; None: no such wrapper."""

    @contextlib.contextmanager
    def full_weights(self) -> Iterator[None]:
        """While inside, the head's and the input embedding's parameters are full tensors on every
        rank, also where the engine partitions them between steps (ZeRO-3's placeholders,
        FSDP1's flat shards: `aniso_plugins.numerics.gathered`). Collective: every rank enters it.
        Read-only; nothing is gathered where the engine keeps them whole or as DTensors."""
        with gathered([self.head(), self.input_embedding()], self.engine_root):
            yield

    def block_positions(self, per_position: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's part of a (..., T) per-position tensor of the micro-batch (targets, token
        ids) at the blocks' outputs: its `sequence_mesh` chunk of the last dimension."""
        mesh = self.sequence_mesh
        if mesh is None or per_position is None:
            return per_position
        start, stop = vocab_shard_rows(mesh, per_position.shape[-1])
        return per_position[..., start:stop]

    @property
    def block_stats_over(self) -> str:
        """The `Stat` scope of statistics of the blocks' outputs: "world" when the ranks of a
        sequence-parallel group hold distinct positions, else "batch"."""
        return "batch" if self.sequence_mesh is None else "world"

    def head(self) -> nn.Module:
        """The output projection module (owns ``weight``, shape (V, d))."""
        return _get(self.model, self._head)

    def head_bypass(self) -> str | None:
        """What in the model's training forward computes the loss from the head's weight without
        calling the head module (a fused kernel's patch), or None: read by subclasses that know
        the model's code (`aniso_plugins.models.handle.OutputEmbeddingsHandle`)."""
        return None

    @property
    def device(self) -> torch.device:
        """Where the head's tensors live (the model's device once the trainer has placed it): the
        device of per-step state and of the collectives' tensors. Read from the head's own
        tensors, not ``head().weight``, which a low-rank head forms as A·B: a product an
        engine's flattened or partitioned parameters cannot give between steps."""
        head = self.head()
        for t in (*head.parameters(), *head.buffers(), *(v for v in vars(head).values() if isinstance(v, torch.Tensor))):
            return t.device
        return head.weight.device

    def head_weight(self) -> torch.Tensor:
        """The (V, d) matrix the head multiplies by, for metrics: ``head().weight`` (a LoRA-adapted
        head's W + ΔW in `aniso_plugins.models.handle.OutputEmbeddingsHandle`)."""
        return self.head().weight

    def vocab_shard(self) -> VocabShard | None:
        """This rank's vocabulary shard of the head inside its forward (`vocab_mesh`), or None."""
        return None if self.vocab_mesh is None else VocabShard.of(self.vocab_mesh, self.vocab_size)

    def head_weight_in_forward(self) -> torch.Tensor:
        """``head().weight`` as the loss terms read it inside the head's forward: with
        `vocab_mesh`, this rank's vocabulary shard as a ``Shard(0)`` DTensor of the (V, d)
        weight on that mesh (differentiable into the shard), so that the row terms reduce over
        the shards; otherwise the weight itself."""
        weight = self.head().weight
        mesh = self.vocab_mesh
        if mesh is None:
            return weight
        from torch.distributed.tensor import DTensor, Shard

        rows = vocab_shard_rows(mesh, self.vocab_size)
        if weight.shape[0] != rows[1] - rows[0]:
            raise SetupError(
                f"the LM head's weight inside its forward has {weight.shape[0]} rows; the vocabulary shard of rank "
                f"{mesh.get_local_rank()} of {mesh.size()} on {mesh.mesh_dim_names} is rows {rows} of {self.vocab_size}"
            )
        return DTensor.from_local(weight, mesh, [Shard(0)], run_check=False, shape=(self.vocab_size, weight.shape[1]),
                                  stride=(weight.shape[1], 1))

    def register_logits_hook(self, hook: Callable[[torch.Tensor], None]) -> None:
        """Call ``hook(logits)`` after every forward with the logits the model's loss reads: the
        head's output here (`OutputEmbeddingsHandle`: the model output's ``logits``, after any
        logit bias or soft-cap the model applies to the head's output); removed by `restore`."""

        def on_output(module: nn.Module, args, output) -> None:
            if isinstance(output, torch.Tensor):
                hook(output)

        self.on_restore(self.head().register_forward_hook(on_output).remove)

    def require_trainable_head(self, who: str) -> None:
        """Raise `SetupError` unless the head's own weight is trained (and is no embedding lookup):
        `who` (a method that changes the head's gradient) would otherwise silently do nothing."""
        self._refuse_lookup_head(who)
        weight = self.head().weight
        if not weight.requires_grad:
            raise SetupError(
                f"{who} changes the gradient of the LM head's weight, but it is frozen (requires_grad=False): "
                "train the head (with PEFT: LoraConfig(modules_to_save=[<the head's name>])) or drop the method"
            )

    def set_head(self, module: nn.Module) -> None:
        """Replace the output projection (before the model is wrapped by DDP/FSDP); undone by
        `restore`."""
        previous = self.head()
        self._replace_head(module)
        self.on_restore(lambda: self._replace_head(previous), surgery=True)

    def _replace_head(self, module: nn.Module) -> None:
        _set(self.model, self._head, module)
        self._head_shape = tuple(full_shape(module.weight))

    def complete_saved_state(self, module: nn.Module, complete: Callable[[dict[str, torch.Tensor], str], object]) -> None:
        """Have ``complete(state_dict, prefix)`` fill in, for `module` (a submodule of the model;
        `prefix` its path in the model's state dict, with the dot), every state dict the
        framework saves that was built without ``Module.state_dict()``, whose own
        ``_save_to_state_dict`` and hooks see the others; undone, as part of the head surgery, by
        `restore`. A plain torch model has no such save (Lightning's checkpoint is its
        ``state_dict()``): nothing to do here. `aniso_plugins.models.handle.OutputEmbeddingsHandle`
        completes the dict handed to ``save_pretrained(state_dict=...)`` (DeepSpeed ZeRO-3's
        consolidated weights; FSDP's full state dict)."""

    def module_path(self, module: nn.Module) -> str:
        """The path of `module` inside the model (``""``: the model itself); a `SetupError` if it
        is not inside."""
        for name, candidate in self.model.named_modules(remove_duplicate=False):
            if candidate is module:
                return name
        raise SetupError(f"{type(module).__name__} is not a submodule of {type(self.model).__name__}")

    # --- the journal ------------------------------------------------------------------------
    def on_restore(self, undo: Callable[[], None], *, surgery: bool = False) -> None:
        """Record how to undo a change made to the model: instrumentation (a hook handle's
        ``remove``, a forward installed in place) or, with `surgery`, a change of the model's
        own parameters or structure (a replaced or untied head)."""
        if not self._undo:
            _HANDLES.setdefault(self.model, []).append(self)
        self._undo.append((undo, surgery))

    @property
    def modified(self) -> bool:
        """Whether set-up changed anything that `restore` would undo."""
        return bool(self._undo)

    def restore(self, keep_surgery: bool = False) -> None:
        """Undo every recorded change, newest first; with `keep_surgery` only the
        instrumentation (hooks, installed forwards), keeping a replaced or untied head (whose
        trained Parameters are the run's result)."""
        kept = []
        while self._undo:
            undo, surgery = self._undo.pop()
            if surgery and keep_surgery:
                kept.append((undo, surgery))
            else:
                undo()
        self._undo = kept[::-1] if keep_surgery else []
        if not self._undo and self in _HANDLES.get(self.model, ()):
            _HANDLES[self.model].remove(self)

    def input_embedding(self) -> nn.Module | None:
        """The token embedding, or None if the model has none reachable."""
        return _get(self.model, self._embedding) if self._embedding else None

    def blocks(self) -> Sequence[nn.Module]:
        """The transformer blocks, in order (empty if unknown)."""
        return list(_get(self.model, self._blocks)) if self._blocks else []

    def hook_blocks(self, make_hook: Callable[[int], Callable], who: str) -> int:
        """Register ``make_hook(i)`` as a forward hook on block i of every block, each removed by
        `restore`; returns the number of blocks. `who` names the caller in the `SetupError`
        raised when the handle knows no blocks."""
        blocks = self.blocks()
        if not blocks:
            raise SetupError(
                f"{who} needs the transformer blocks: build the ModelHandle with "
                "blocks='<path of the nn.ModuleList of blocks>'"
            )
        for i, block in enumerate(blocks):
            self.on_restore(block.register_forward_hook(make_hook(i)).remove)
        return len(blocks)

    @property
    def vocab_size(self) -> int:
        """V, the rows of the head's weight (as set up: also where an engine partitions it)."""
        return self._head_shape[0]

    @property
    def hidden_size(self) -> int:
        """d, the columns of the head's weight."""
        return self._head_shape[1]

    def tied(self) -> bool:
        """True when the head and the input embedding share one weight Parameter."""
        emb = self.input_embedding()
        return emb is not None and getattr(emb, "weight", None) is self.head().weight

    def untie(self) -> None:
        """Give the head an independent copy of the shared weight (no-op when not tied); undone
        by `restore` (the head gets the shared Parameter back)."""
        if not self.tied():
            return
        head = self.head()
        shared = head.weight
        head.weight = nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad)
        self.on_restore(lambda: setattr(head, "weight", shared), surgery=True)
        if self._on_untie is not None:
            self._on_untie()

    def _refuse_lookup_head(self, who: str) -> None:
        """Raise `SetupError` where the head named is an embedding lookup: it makes no logits to train."""
        if isinstance(self.head(), nn.Embedding):
            raise SetupError(f"{who} trains the LM head, but the head named, {self._head!r}, is an embedding lookup that "
                             f"makes no logits (only metrics can read it): use {self._model_with_head()}")

    def _model_with_head(self) -> str:
        """What to use instead of a model whose head is an embedding lookup (a subclass that knows the
        model's family names its classes with a head)."""
        return "an LM head"


def detach(model: nn.Module, keep_surgery: bool = False) -> int:
    """Undo what every aniso_plugins set-up did to `model` (or a module inside it) that was not
    undone yet, e.g. by a Trainer of a notebook cell run before whose callback is gone; returns
    how many set-ups were undone. `keep_surgery` keeps replaced or untied heads."""
    done = 0
    for root, handles in list(_HANDLES.items()):
        if root is model or any(m is model for m in root.modules()) or any(m is root for m in model.modules()):
            for handle in list(handles)[::-1]:
                handle.restore(keep_surgery)
                done += 1
    return done


__all__ = ["ModelHandle", "SetupError", "detach"]
