"""``method="coupled_adam"``: the trainer's Adam / AdamW updates the output embedding by Coupled
Adam (`aniso_plugins.methods.coupled_adam.update`), every other parameter as before."""

from __future__ import annotations

from aniso_plugins.core.config import ConfigError
from aniso_plugins.core.hookspecs import hookimpl
from aniso_plugins.core.model import ModelHandle
from aniso_plugins.core.plugin_base import Plugin
from aniso_plugins.core.steps import RunInfo
from aniso_plugins.methods.coupled_adam.update import CoupledAdam, innermost


class CoupledAdamPlugin(Plugin):
    """Puts `CoupledAdam` on the trainer's optimizer holding the head's weight when training
    begins (`RunInfo.optimizers`, again on every new training run), removed by ``detach``."""

    name = "coupled_adam"
    updates_head_rows = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self.coupled: CoupledAdam | None = None

    def setup(self, model: ModelHandle) -> None:
        self.require_head_parameter(model)
        model.on_restore(self._remove)

    def _remove(self) -> None:
        if self.coupled is not None:
            self.coupled.remove()
            self.coupled = None

    @hookimpl
    def aniso_begin_training(self, run: RunInfo) -> None:
        self._remove()
        if not run.optimizers:
            raise ConfigError(
                "method='coupled_adam' changes the trainer's optimizer, which the adapter did not hand over: pass "
                "TrainingSession.begin_training(optimizers=...)"
            )
        weight = self.model.head().weight
        holding = [o for o in map(innermost, run.optimizers) if any(p is weight for g in o.param_groups for p in g["params"])]
        if not holding:
            raise ConfigError(
                f"method='coupled_adam': the LM head's weight {tuple(weight.shape)} is in none of the trainer's optimizers "
                f"({', '.join(type(o).__name__ for o in run.optimizers)}): let the trainer's optimizer train the LM head"
            )
        self.coupled = CoupledAdam(holding[0], [weight], decay=self.config.coupled_adam_decay,
                                   scale=self.config.coupled_adam_scale)


__all__ = ["CoupledAdamPlugin"]
