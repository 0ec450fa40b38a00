"""How a transformers model's loss pairs its LM head's output positions with a batch's labels
(`alignment_of`), read from the model: its config, its forward's code
(`aniso_plugins.models.causal_loss.label_alignment_in_forward`), transformers' lists of causal-
and masked-LM classes. The adapters hand it to `aniso_plugins.core.targets.target_rule` as the
default of their ``targets=`` option; docs/design.md "Targets" has the table."""

from __future__ import annotations

from torch import nn

from aniso_plugins.core.errors import SetupError
from aniso_plugins.core.targets import SEQ2SEQ, TARGETS_HINT, LabelAlignment
from aniso_plugins.models.causal_loss import label_alignment_in_forward, labels_passed_to

_CAUSAL_LOSS_TYPES = ("ForCausalLM", "ForConditionalGeneration")  # transformers' LOSS_MAPPING: both shift


def _auto_class_names() -> tuple[set[str], set[str]]:
    """(causal-LM, masked-LM) class names of transformers' auto mappings (empty without it)."""
    try:
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        )
    except ImportError:
        return set(), set()

    def names(mapping) -> set[str]:
        out: set[str] = set()
        for value in mapping.values():
            out.update(value if isinstance(value, (tuple, list)) else (value,))
        return out

    return names(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), names(MODEL_FOR_MASKED_LM_MAPPING_NAMES)


def alignment_of(model: nn.Module) -> LabelAlignment:
    """The `LabelAlignment` of a transformers model, from what its own loss does: an
    encoder-decoder (``config.is_encoder_decoder``) -> "seq2seq"; else as its forward's code
    aligns the labels in its loss (`label_alignment_in_forward`: shifted -> "causal", as they
    are -> "aligned"; transformers lists Bart's, Marian's, XLNet's... unshifting classes as
    causal LMs); where the code does not say, a class transformers lists as a causal LM, or
    whose ``loss_type`` is a shifting one -> "causal", a masked LM (listed, or ``loss_type ==
    "ForMaskedLM"``) -> "aligned". Raises `SetupError` naming the ``targets=`` way out when it
    cannot tell (no such evidence, contradicting evidence, or a loss computed by a submodule
    that is handed the labels)."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        computed_by = labels_passed_to(model, methods=True)
        if computed_by is not None:
            raise SetupError(
                f"cannot tell how {name}'s loss aligns its logits with its labels: its forward hands the labels to "
                f"{computed_by}, a loss of its own (ProphetNet trains its n-gram streams there); {TARGETS_HINT}"
            )
        return SEQ2SEQ
    in_code = label_alignment_in_forward(model)
    if in_code is not None:
        return LabelAlignment(in_code)
    computed_by = labels_passed_to(model)
    if computed_by is not None:
        raise SetupError(
            f"cannot tell how {name}'s loss aligns its logits with its labels: its forward hands the labels to "
            f"{computed_by}, whose loss it does not show; {TARGETS_HINT}"
        )
    causal_names, masked_names = _auto_class_names()
    votes = set()
    if name in causal_names:
        votes.add("causal")
    if name in masked_names:
        votes.add("aligned")
    loss_type = getattr(model, "loss_type", None)
    if loss_type in _CAUSAL_LOSS_TYPES:
        votes.add("causal")
    elif loss_type == "ForMaskedLM":
        votes.add("aligned")
    if len(votes) == 1:
        return LabelAlignment(votes.pop())
    why = (
        "it is listed both as a causal and as a masked LM"
        if votes
        else f"it is neither an encoder-decoder nor a class transformers lists as a causal or masked LM (loss_type={loss_type!r})"
    )
    raise SetupError(f"cannot tell how {name}'s loss aligns its logits with its labels: {why}; {TARGETS_HINT}")


__all__ = ["alignment_of"]
