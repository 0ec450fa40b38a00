"""The options of The gradient-bottleneck probe and the update efficiency, docs/methods.md §9: fields of `aniso_plugins.AnisoConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from aniso_plugins.core.errors import ConfigError
from aniso_plugins.core.options import FloatList, Options, check_positive_int, check_positive_or_none, list_field


@dataclass(frozen=True)
class BottleneckOptions(Options):
    """The gradient-bottleneck probe and the update efficiency."""

    SEQUENCES = {"update_efficiency_eps": float}

    bottleneck_every: int | None = None
    """Optimizer steps between gradient-bottleneck probes; None: metrics_every."""
    update_efficiency: bool = False
    """With the "bottleneck" metric: also measure the update efficiency through the head on
    each probed micro-batch (docs/methods.md §9.5). Costs 2kVd flops in the backward, 3kV
    float32 values kept until the measurement, and (1 + 2·len(update_efficiency_eps)) float64
    log-sum-exps over k×V at the measurement, k = update_efficiency_positions."""
    update_efficiency_eps: FloatList = list_field(0.001, 0.01, 0.1)
    """Logit-update budgets ε, as fractions of ‖Z‖_F, of the update-efficiency probe."""
    update_efficiency_positions: int = 256
    """Positions per rank the update-efficiency probe keeps (k rows of logits and gradients)."""

    def validate(self) -> None:
        check_positive_or_none("bottleneck_every", self.bottleneck_every)
        check_positive_int("update_efficiency_positions", self.update_efficiency_positions)
        if self.update_efficiency and "bottleneck" not in self.metrics:
            raise ConfigError(
                f"update_efficiency=True: the probe runs on the gradient-bottleneck probe's micro-batch; add "
                f"'bottleneck' to metrics (metrics={self.metrics!r})"
            )
        if not self.update_efficiency_eps or any(not (0 < e <= 1) for e in self.update_efficiency_eps):
            raise ConfigError(
                f"update_efficiency_eps={self.update_efficiency_eps!r}: expected one or more fractions of ‖Z‖ in (0, 1]"
            )


__all__ = ["BottleneckOptions"]
