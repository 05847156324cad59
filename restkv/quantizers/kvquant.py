"""``--quant_method kvquant``: KIVI's codes with KVQuant's dense-and-sparse split (arXiv 2401.18079):
each vector's outliers kept exactly in a side store."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import ConfigError, option, register
from restkv.quantizers.kivi import KIVI


def percentile_outliers(x: torch.Tensor, member: torch.Tensor, fraction: float, per_channel: bool) -> torch.Tensor:
    """KVQuant's per-vector outliers: bool ``[..., S, d]``, the ``member`` elements of ``x`` at or
    beyond their vector's ``1 - fraction / 2`` and ``fraction / 2`` quantiles (upper and lower
    apart; a vector is a channel over the tokens, ``per_channel``, or a token over its channels),
    the quantiles taken over the vector's members (KVQuant's ``get_outliers_dynamic``)."""
    dim = -2 if per_channel else -1
    values = x.float().masked_fill(~member, float("nan"))
    upper = torch.nanquantile(values, 1 - fraction / 2, dim=dim, keepdim=True)
    lower = torch.nanquantile(values, fraction / 2, dim=dim, keepdim=True)
    return member & ((values >= upper) | (values <= lower))


@register("quantization")
@dataclass(frozen=True)
class KVQuant(KIVI):
    """KIVI's codes with KVQuant's dense-and-sparse split: per-vector outliers and the first
    tokens kept exactly in a sparse side store."""

    name = "kvquant"
    reference = "KVQuant: Hooper et al., NeurIPS 2024, arXiv 2401.18079"

    quant_outlier_fraction: float = option(
        0.01, "--quant_method kvquant: share of each vector's elements kept exactly in the sparse side store, half "
        "from each end (KVQuant's per-vector percentile thresholds: a key channel over its tokens, a value token "
        "over its channels, computed when quantised; below 1)", minimum=0, exclusive_minimum=True,
    )
    quant_outlier_threshold: float | None = option(
        None, "--quant_method kvquant: a fixed threshold instead of the percentiles (the original release's, 6): "
        "elements with a magnitude above it are kept exactly", minimum=0, exclusive_minimum=True,
    )
    quant_exact_sinks: int = option(
        5, "--quant_method kvquant: the first prompt tokens kept exactly, keys and values (KVQuant's attention-sink-"
        "aware quantisation, its --first_few_fp16)", minimum=0,
    )

    def validate(self) -> None:
        super().validate()
        if self.quant_outlier_fraction >= 1:
            raise ConfigError(f"--quant_outlier_fraction must be a fraction in (0, 1); got "
                              f"{self.quant_outlier_fraction}")

    @property
    def exact_sinks(self) -> int:
        return self.quant_exact_sinks

    def outliers(self, x: torch.Tensor, member: torch.Tensor, per_channel: bool) -> torch.Tensor:
        if self.quant_outlier_threshold is not None:
            return member & (x.abs() > self.quant_outlier_threshold)
        return percentile_outliers(x, member, self.quant_outlier_fraction, per_channel)
