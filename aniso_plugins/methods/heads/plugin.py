"""Head surgery at setup: an untied or a low-rank LM head (``config.head``).

Runs first among the setup hooks (``tryfirst``), so wrappers of the final head (AGG's gated
forward) and probes see the replaced head: ``AnisoConfig(method="agg", head="untie")`` gates
an untied head.

- "untie": `ModelHandle.untie()`: the head gets an independent copy of the weight it shares
  with the input embedding, and the handle's ``on_untie`` keeps the framework from re-tying it
  (HF: ``config.tie_word_embeddings = False``, so ``save_pretrained`` writes both matrices and
  ``from_pretrained`` loads them untied). A head that is not tied (or a model without a
  reachable input embedding) is left as it is, silently: "untie" means "make sure it is
  independent".
- "lowrank": the head becomes `LowRankHead.from_linear(head, lowrank_rank, lowrank_init)`
  (W = A·B, seed 001). A tied model is untied first: the low-rank head is independent of the
  input embedding, which keeps the original matrix. A save holds ``lm_head.weight`` = A·B
  beside ``lm_head.A`` / ``lm_head.B`` (the head's state dict; and, registered here with
  `ModelHandle.complete_saved_state`, a state dict handed to ``save_pretrained`` by the HF
  Trainer under ZeRO-3 or FSDP): ``from_pretrained`` of the original class loads the trained
  head, a resume the factors. `aniso_plugins.merge_low_rank_heads(model)` remains the clean
  export (``lm_head.weight`` only).
"""

from __future__ import annotations

from aniso_plugins.core.config import AnisoConfig, ConfigError
from aniso_plugins.core.hookspecs import hookimpl
from aniso_plugins.core.layout import ParallelLayout
from aniso_plugins.core.model import ModelHandle, SetupError
from aniso_plugins.core.plugin_base import Plugin
from aniso_plugins.methods.heads.lowrank import LowRankHead


class HeadSurgeryPlugin(Plugin):
    """Untied or low-rank LM head, set up before any other plugin (see the module docstring)."""

    name = "head"

    def __init__(self, config: AnisoConfig) -> None:
        if config.head not in ("untie", "lowrank"):
            raise ConfigError(f"head={config.head!r}: HeadSurgeryPlugin handles 'untie' and 'lowrank'")
        super().__init__(config)

    def refuse_layout(self, layout: ParallelLayout) -> str | None:
        if layout.parameters_fixed is None:
            return None
        return f"head={self.config.head!r} adds parameters to the model, but {layout.parameters_fixed}"

    @hookimpl(tryfirst=True)
    def aniso_setup(self, model: ModelHandle, config: AnisoConfig) -> None:
        """The base's set-up, declared again to run before the other plugins' (``tryfirst``)."""
        Plugin.aniso_setup(self, model, config)

    def setup(self, model: ModelHandle) -> None:
        config = self.config
        model.require_trainable_head(f"head={config.head!r}")
        if config.head == "untie":
            model.untie()
            return
        try:  # built (and its rank checked) before anything about the model changes
            head = LowRankHead.from_linear(model.head(), config.lowrank_rank, init=config.lowrank_init)
        except ValueError as e:
            raise SetupError(f"head='lowrank' (lowrank_rank={config.lowrank_rank}): {e}") from e
        model.untie()
        model.set_head(head)
        model.complete_saved_state(head, head.add_merged_weight)


__all__ = ["HeadSurgeryPlugin"]
