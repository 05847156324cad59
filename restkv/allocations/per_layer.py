"""``--allocation per_layer``: each layer its own compression ratio (kvpress' PerLayerCompressionPress)."""

from __future__ import annotations

from dataclasses import dataclass

from restkv.allocations.uniform import Uniform
from restkv.config import kept_at_ratio
from restkv.config.options import ConfigError, option, register


@register("allocation")
@dataclass(frozen=True)
class PerLayerRatios(Uniform):
    """Each layer its own compression ratio (kvpress' PerLayerCompressionPress): layer ``l`` keeps
    ``floor(n (1 - r_l))`` of the ``n`` tokens its row has seen, window included, at most the run's
    budget (the largest any layer keeps, and the memory bound); a row within the budget is kept whole.
    Under ``--prefill_chunk_size`` and ``--decode_budget`` ``n`` counts every token seen so far, not
    only those the layer holds."""

    name = "per_layer"
    reference = "kvpress' PerLayerCompressionPress (NVIDIA kvpress)"

    layer_ratios: tuple[float, ...] = option((), "--allocation per_layer: the compression ratio of each layer, in "
                                                 "layer order, one per layer of the model")

    def validate(self) -> None:
        if not all(0 <= ratio < 1 for ratio in self.layer_ratios):
            raise ConfigError(f"--layer_ratios must be fractions in [0, 1); got {self.layer_ratios!r}")

    def check(self, config) -> None:
        if not self.layer_ratios:
            raise ConfigError("--allocation per_layer gives each layer its own ratio: give --layer_ratios R0 R1 ...")

    def check_model(self, config, model) -> None:
        self.check_layers(model.num_layers)

    def check_layers(self, num_layers: int) -> None:
        if len(self.layer_ratios) != num_layers:
            raise ConfigError(f"--layer_ratios gives {len(self.layer_ratios)} ratios; the model has {num_layers} "
                              "layers: give one per layer")

    def layer_budget(self, budget, seen, layer_idx, num_layers):
        self.check_layers(num_layers)
        return budget if seen <= budget else min(budget, kept_at_ratio(seen, self.layer_ratios[layer_idx]))
