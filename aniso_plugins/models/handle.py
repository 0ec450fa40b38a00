"""Where a transformers model keeps what the plugins act on: its LM head (the module that makes
the logits, `output_projection`), its input embedding and blocks (an encoder-decoder's decoder
side), and PEFT's wrappers of them (`peft_base_model`, ``modules_to_save`` copies, LoRA layers).
`OutputEmbeddingsHandle` is the `ModelHandle` the adapters build for such a model, `find_handle`
the one for any module that holds one. Duck-typed: transformers is imported only to name the
classes with an LM head in an error."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from aniso_plugins.core.errors import SetupError
from aniso_plugins.core.model import ModelHandle
from aniso_plugins.models.head_bypass import head_bypass_in_forward
from aniso_plugins.models.saving import Completion, complete_save_pretrained
from aniso_plugins.numerics.gathered import full_shape

_MISSING = object()


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
        head = super().head()
        copies = _peft_copies(head)
        if copies is None:
            return head
        active = _active_adapters(head)
        return copies[active[0]] if active and active[0] in copies else head.original_module

    def head_bypass(self) -> str | None:  # type: ignore[override]
        """`head_bypass_in_forward` of the model's forward and its head's attribute."""
        return head_bypass_in_forward(self.model, self._head if "." not in self._head else "")

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
        self._refuse_lookup_head(who)
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

    def complete_saved_state(self, module: nn.Module, complete: Completion) -> None:
        """``save_pretrained(state_dict=given)`` completes `given` for `module`
        (`aniso_plugins.models.saving`): the HF Trainer hands it the state dict under DeepSpeed
        ZeRO-3 and FSDP."""
        undo = complete_save_pretrained(self.model, complete, self.module_path(module) + ".")
        if undo is not None:
            self.on_restore(undo, surgery=True)

    def _model_with_head(self) -> str:
        return _with_head(self.model) or "an LM head"

    def _head_name(self) -> str:
        return self._head.rsplit(".", 1)[-1]

    def _replace_head(self, module: nn.Module) -> None:
        head = super().head()
        copies = _peft_copies(head)
        active = _active_adapters(head) if copies is not None else []
        if active and active[0] in copies:
            copies[active[0]] = module
            self._head_shape = tuple(full_shape(module.weight))
        else:
            super()._replace_head(module)

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


__all__ = ["OutputEmbeddingsHandle", "find_handle", "output_projection", "peft_base_model"]
