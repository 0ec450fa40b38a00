"""How plugins reach the parts of a model they act on: the LM head, the input embedding, the
transformer blocks. Adapters build a `ModelHandle` for their trainer's model; plugins never
guess attribute names themselves.

The handle is also the journal of what set-up did to the model: `set_head`, `untie` and every
change a plugin registers with `on_restore` (a forward installed in place, a hook) are undone,
newest first, by `restore`. The session calls it when a set-up fails half-way (nothing stays
half-applied) and on `detach` (the model is again exactly what it was: same modules, same
Parameters, same tying, same forwards)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from aniso_plugins.core.errors import SetupError
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


_MISSING = object()
_HANDLES: weakref.WeakKeyDictionary[nn.Module, list[ModelHandle]] = weakref.WeakKeyDictionary()
"""Per model, the handles whose journal holds changes to it (what `detach` undoes)."""


class ModelHandle:
    """Access to a causal LM's head, input embedding and blocks by submodule path.

    ``framework_wraps_head_forward``: the trainer sets an instance ``forward`` on the head
    around its class forward that changes no value (torchtitan's), so a forward installed in
    place over it is not replacing user code.

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
    vocab_mesh: DeviceMesh | None = None
    """The 1-D device mesh whose ranks each hold a contiguous vocabulary shard of the head's
    weight inside its forward (tensor parallelism with loss parallel: a rank's logits are its
    shard's, ``torch.chunk`` rows of the (V, d) weight); None: the forward sees all V rows."""

    backward_runs_twice: bool = False
    """Whether the trainer runs the backward of one forward twice on the retained graph (zero-bubble
    pipeline schedules: input gradients, then weight gradients); the fused loss keeps its
    gradients for the second one."""
    sequence_mesh: DeviceMesh | None = None
    """The 1-D device mesh whose ranks each hold a contiguous ``torch.chunk`` of the sequence
    positions at the blocks' outputs (sequence parallelism); None: a rank's block outputs cover
    its whole micro-batch."""
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

    def head_weight(self) -> torch.Tensor:
        """The (V, d) matrix the head multiplies by, for metrics: ``head().weight`` (a LoRA-adapted
        head's W + ΔW in `OutputEmbeddingsHandle`)."""
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
        _refuse_lookup_head(self, who)
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


def peft_base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT ``PeftModel`` (duck-typed: ``get_base_model()`` and
    ``peft_config``), else `model` itself."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) and hasattr(model, "peft_config") else model


def _peft_copies(module: nn.Module) -> nn.ModuleDict | None:
    """The per-adapter trained copies of a PEFT ``ModulesToSaveWrapper``, else None."""
    copies = getattr(module, "modules_to_save", None)
    return copies if isinstance(copies, nn.ModuleDict) and hasattr(module, "original_module") else None


def _active_adapters(module: nn.Module) -> list[str]:
    return [] if getattr(module, "disable_adapters", False) else list(getattr(module, "active_adapters", ()))


def _refuse_lookup_head(handle: ModelHandle, who: str) -> None:
    if isinstance(handle.head(), nn.Embedding):
        raise SetupError(f"{who} trains the LM head, but the head named, {handle._head!r}, is an embedding lookup that "
                         f"makes no logits (only metrics can read it): use {_with_head(handle.model) or 'an LM head'}")


def _lora_layer(module: nn.Module) -> bool:
    """Whether `module` is a PEFT LoRA layer (a frozen ``base_layer`` plus trained A·B)."""
    return callable(getattr(module, "get_delta_weight", None)) and hasattr(module, "base_layer") and hasattr(module, "lora_A")


class OutputEmbeddingsHandle(ModelHandle):
    """`ModelHandle` for a model with the transformers API (duck-typed, transformers need not be
    installed): the head is the projection that makes the logits (`output_projection`; or the
    submodule at `head`, a path in the base model), the embedding
    ``get_input_embeddings()``, the blocks the modules whose class is in ``_no_split_modules``;
    untying sets ``tie_word_embeddings=False`` on the config (and its text config) so that
    nothing re-ties the weights.

    Encoder-decoders (``config.is_encoder_decoder``): the head is the decoder's, so the blocks
    are the decoder's and the input embedding is the decoder's token embedding (the shared one
    of T5, Bart, Marian). PEFT: a ``PeftModel`` is unwrapped to its base model; a head in
    ``modules_to_save`` is its active trained copy (the module that runs); a LoRA-adapted head
    reads as W + ΔW for metrics (`head_weight`) and is refused by the methods that change the
    head's gradient (`require_trainable_head`)."""

    def __init__(self, model: nn.Module, head: str | None = None) -> None:
        base = peft_base_model(model)
        self.peft = base is not model
        """Whether the model came wrapped in a PEFT ``PeftModel``."""
        model = base
        if head is None:
            head = output_projection(model)
        else:
            _get(model, head)
        super().__init__(model, head=head, on_untie=self._mark_untied)

    @property
    def head_skips_label(self) -> int | None:  # type: ignore[override]
        """ModernBERT-style ``sparse_prediction``: the head runs on the rows whose label is not
        ``sparse_pred_ignore_index`` (`ModelHandle.head_skips_label`)."""
        if not getattr(self.model, "sparse_prediction", False):
            return None
        return int(getattr(self.model, "sparse_pred_ignore_index", -100))

    @property
    def encoder_decoder(self) -> bool:
        return bool(getattr(getattr(self.model, "config", None), "is_encoder_decoder", False))

    def head(self) -> nn.Module:
        head = _get(self.model, self._head)
        copies = _peft_copies(head)
        if copies is None:
            return head
        active = _active_adapters(head)
        return copies[active[0]] if active and active[0] in copies else head.original_module

    def head_weight(self) -> torch.Tensor:
        head = self.head()
        if not _lora_layer(head) or getattr(head, "merged", False):
            return head.weight
        with torch.no_grad():
            weight = head.get_base_layer().weight.detach()
            for adapter in _active_adapters(head):
                if adapter in head.lora_A:
                    weight = weight + head.get_delta_weight(adapter).to(weight.dtype)
        return weight

    def require_trainable_head(self, who: str) -> None:
        _refuse_lookup_head(self, who)
        head = self.head()
        name = self._head_name()
        if _lora_layer(head):
            raise SetupError(
                f"{who} changes the gradient of the LM head's weight W, but LoRA on the head ({name!r} in "
                "target_modules) freezes W and trains A·B beside it: refused. Train the head in full instead: "
                f"LoraConfig(modules_to_save=[{name!r}]) without it in target_modules"
            )
        if not head.weight.requires_grad:
            raise SetupError(
                f"{who} changes the gradient of the LM head's weight, but it is frozen (requires_grad=False)"
                + (
                    f": with PEFT, train the head too, LoraConfig(modules_to_save=[{name!r}])"
                    if self.peft
                    else f": unfreeze {name!r} or drop the method"
                )
            )

    def register_logits_hook(self, hook: Callable[[torch.Tensor], None]) -> None:
        def on_output(module: nn.Module, args, output) -> None:
            logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
            if isinstance(logits, torch.Tensor):
                hook(logits)

        self.on_restore(self.model.register_forward_hook(on_output).remove)

    def _head_name(self) -> str:
        return self._head.rsplit(".", 1)[-1]

    def _replace_head(self, module: nn.Module) -> None:
        head = _get(self.model, self._head)
        copies = _peft_copies(head)
        active = _active_adapters(head) if copies is not None else []
        if active and active[0] in copies:
            copies[active[0]] = module
        else:
            _set(self.model, self._head, module)
        self._head_shape = tuple(full_shape(module.weight))

    def _decoder(self) -> nn.Module | None:
        get = getattr(self.model, "get_decoder", None)
        if not self.encoder_decoder or not callable(get):
            return None
        try:
            return get()
        except (AttributeError, NotImplementedError):
            return None

    def input_embedding(self) -> nn.Module | None:
        decoder = self._decoder()
        for owner in ((decoder, self.model) if decoder is not None else (self.model,)):
            try:
                embedding = owner.get_input_embeddings()
            except (AttributeError, NotImplementedError):
                continue
            if embedding is not None:
                return embedding
        return None

    def blocks(self) -> list[nn.Module]:
        """The blocks feeding the head (an encoder-decoder's decoder blocks): the modules whose
        class is in ``_no_split_modules``, else the first ``nn.ModuleList`` of same-class
        modules (Marian declares none)."""
        decoder = self._decoder()
        root = decoder if decoder is not None else self.model
        names = set(getattr(self.model, "_no_split_modules", None) or ())
        found = [m for m in root.modules() if type(m).__name__ in names]
        if found:
            return found
        for module in root.modules():
            if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
                return list(module)
        return []

    def _mark_untied(self) -> None:
        config = getattr(self.model, "config", None)
        if config is None:
            return
        configs = [config]
        if callable(getattr(config, "get_text_config", None)):
            configs.append(config.get_text_config())
        before = [(cfg, cfg.tie_word_embeddings) for cfg in configs]
        for cfg in configs:
            cfg.tie_word_embeddings = False
        self.on_restore(lambda: [setattr(cfg, "tie_word_embeddings", value) for cfg, value in before], surgery=True)
        expand = getattr(self.model, "get_expanded_tied_weights_keys", None)
        if callable(expand):  # transformers caches the tie mapping; init_weights() re-ties from it
            cached = self.model.__dict__.get("all_tied_weights_keys", _MISSING)
            self.model.all_tied_weights_keys = expand(all_submodels=True)
            self.on_restore(lambda: self._restore_attribute("all_tied_weights_keys", cached), surgery=True)

    def _restore_attribute(self, name: str, value: object) -> None:
        if value is _MISSING:
            self.model.__dict__.pop(name, None)
        else:
            setattr(self.model, name, value)


def _rows(module: nn.Module | None) -> tuple[int, int] | None:
    """The (rows, columns) of a module's 2-D ``weight`` (a PEFT wrapper's: its trained copy's or
    base layer's), or None."""
    copies = _peft_copies(module) if module is not None else None
    if copies is not None:
        module = next(iter(copies.values()), module)
    weight = getattr(module, "weight", None)
    shape = tuple(full_shape(weight)) if isinstance(weight, torch.Tensor) else ()
    return shape if len(shape) == 2 else None


def output_projection(model: nn.Module) -> str:
    """The path of the module that makes a transformers model's logits: ``get_output_embeddings()``
    when it projects onto the vocabulary (a 2-D ``weight`` of V rows, V the rows of the input
    embedding, and not itself an embedding lookup), else the one ``nn.Linear`` of weight (V, d)
    outside the blocks (FSMT's ``decoder.output_projection``; its ``get_output_embeddings()`` is
    the target embedding table, of the same shape). Raises `SetupError` naming what
    ``get_output_embeddings()`` returned when no module, or more than one, makes the logits
    (DeBERTa-v2 with ``legacy=False`` computes h·Eᵀ + b without one)."""
    get = getattr(model, "get_output_embeddings", None)
    declared = get() if callable(get) else None
    if declared is None:
        raise _no_head(model, model)
    paths = {id(module): name for name, module in model.named_modules()}
    shape = _rows(declared)
    if isinstance(declared, nn.Embedding):
        vocabulary = shape  # an embedding table: the logits' vocabulary is its rows
    else:
        embedding = _input_embedding_of(model)
        vocabulary = _rows(embedding) if embedding is not None else None
        transposed = shape is not None and vocabulary is not None and shape == vocabulary[::-1]
        if shape is not None and (vocabulary is None or shape[0] == vocabulary[0] or transposed):
            return paths[id(declared)]  # (a transposed weight is refused by ModelHandle, naming it)
    inside = ("modules_to_save.", "original_module", "base_layer")  # PEFT's copies of a module
    found = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and vocabulary is not None
        and _rows(module) == vocabulary
        and not any(part in name for part in inside)
        and not any(part.isdigit() for part in name.split("."))  # not inside the blocks (a ModuleList)
    ]
    if len(found) == 1:
        return found[0]
    what = f"{paths.get(id(declared), '?')!r} ({type(declared).__name__}, weight {shape})"
    if found:
        raise SetupError(
            f"{type(model).__name__}.get_output_embeddings() is {what}, not a projection onto the vocabulary, and "
            f"{len(found)} modules could be the LM head ({', '.join(found)}): name it, AnisoCallback(..., head='...')"
        )
    raise SetupError(
        f"{type(model).__name__} has no module that makes its logits: get_output_embeddings() is {what}, whose "
        f"output is not the vocabulary ({vocabulary[0] if vocabulary else '?'} ids), and no nn.Linear-like module "
        "projects onto it (the logits are computed without one, e.g. h·Eᵀ + b from the input embedding: "
        "DeBERTa-v2 with legacy=False). aniso_plugins acts on an nn.Linear LM head: build the model with one "
        "(DeBERTa-v2: legacy=True), or name the module that makes the logits, AnisoCallback(..., head='...')"
    )


def _with_head(model: nn.Module) -> str:
    """The masked- and causal-LM classes of `model`'s transformers family ("BertForMaskedLM or ...")."""
    try:
        import transformers
        from transformers.models.auto import modeling_auto as auto
    except ImportError:
        return ""
    kind, family = getattr(getattr(model, "config", None), "model_type", None), type(model).__name__.removesuffix("Model")
    names = [t.get(kind) for t in (auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES, auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)]
    names += [n for n in (f"{family}ForMaskedLM", f"{family}ForCausalLM") if family and hasattr(transformers, n)]
    return " or ".join(dict.fromkeys(n for n in names if isinstance(n, str)))


def _no_head(model: nn.Module, root: nn.Module) -> SetupError:
    """The refusal of `model` (in `root`), whose ``get_output_embeddings()`` is missing or None."""
    embedding = {id(m): path for path, m in root.named_modules()}.get(id(_input_embedding_of(model)))
    return SetupError(
        f"found no LM head in {type(model).__name__} (get_output_embeddings() is missing or None): load "
        f"{_with_head(model) or 'a model with one'} (from_pretrained of the same checkpoint), or name the head: "
        "AnisoCallback(..., head='path.to.head')" + (f"; to measure it without one (metrics of its input embedding and "
        f"hidden states, no method on the head), name its input embedding: head={embedding!r}" if embedding else "")
    )


def _input_embedding_of(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_input_embeddings", None)
    try:
        return get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        return None


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


def find_handle(
    root: nn.Module, *, head: str | None = None, input_embedding: str | None = None, blocks: str | None = None
) -> ModelHandle:
    """The handle for `root`: by submodule paths when `head` is given, else the first module
    (depth-first, `root` included) with the transformers ``get_output_embeddings()`` API."""
    if head is not None:
        return ModelHandle(root, head=head, input_embedding=input_embedding, blocks=blocks)
    bare = [m for m in root.modules() if callable(getattr(m, "get_output_embeddings", None))]
    for module in bare:
        if isinstance(module.get_output_embeddings(), nn.Module):
            return OutputEmbeddingsHandle(module)
    if bare:  # transformers models without an LM head
        raise _no_head(bare[0], root)
    raise SetupError(
        f"found no LM head in {type(root).__name__}: no submodule has get_output_embeddings(); "
        "name it with head='path.to.lm_head' (and input_embedding=, blocks=)"
    )


__all__ = [
    "ModelHandle", "OutputEmbeddingsHandle", "SetupError", "detach", "find_handle", "output_projection", "peft_base_model",
]
