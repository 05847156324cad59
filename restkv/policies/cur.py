"""CUR / CurDKV (Sengupta et al., 2025, arXiv 2509.15038): keys and values by approximate leverage.

A token's score approximates its leverage in the CUR decomposition of the layer's keys and
values by their squared norms: ``k2_i = ||k_i||^2`` and ``v2_i = ||v_i||^2``, each divided by
its sum over consecutive windows of ``--cur_local_window`` tokens (the row's first token opens
the first window; 0: over the whole row), combined as ``--cur_leverage`` (``kv_product``:
``k2 * v2``, the default; ``kv_avg``; ``key``; ``value``) and normalised to sum 1 over the
row. The first ``--n_sink`` tokens score 1, above any other token. With
``--cur_random_projection`` keys and values are first multiplied by a Gaussian matrix
``G / sqrt(r)`` (``d x r``, ``r = --cur_projection_dim``), the randomised leverage estimate.
No attention is read.

Where this differs from kvpress' ``CURPress``: ``G`` comes from a generator seeded with
``--seed`` and the layer (kvpress draws it from the global torch RNG on every call, so its
choice changes with whatever ran before); windows are counted from each row's own first
token; ``--cur_local_window 0`` normalises the key and the value norms over the whole row, where
kvpress' ``use_local_approximation=False`` leaves them raw (the same ranking except under
``kv_avg``, where raw norms weigh keys and values by their scale, not by their leverage); a window
whose norms are all zero scores 0 (kvpress divides by zero); the recent
``--window_size`` tokens are kept as for every restkv scorer (kvpress protects only the sinks:
``--window_size 0`` reproduces it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from restkv.config.options import option, register
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import Policy, SinkOptions
from restkv.policies.random_control import layer_generator
from restkv.policies.row_local import score_rows

LEVERAGES = ("kv_product", "kv_avg", "key", "value")


@register("method")
@dataclass(frozen=True)
class CUR(SinkOptions, Policy):
    name = "cur"
    reference = "CurDKV: Sengupta et al., 2025, arXiv 2509.15038"
    observes_queries = False

    cur_leverage: str = option("kv_product", "CUR: how the key and value leverages combine", LEVERAGES)
    cur_local_window: int = option(
        16, "CUR: tokens per window within which the squared norms are normalised (0: the whole row; kvpress' "
        "use_local_approximation=False leaves them raw, which for kv_avg weighs keys and values by their scale)",
        minimum=0
    )
    cur_random_projection: bool = option(
        False, "CUR: project keys and values on a seeded Gaussian matrix before taking their norms"
    )
    cur_projection_dim: int = option(20, "CUR: columns of the --cur_random_projection matrix", minimum=1)

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        keys, values = ctx.key.float(), ctx.value.float()
        if self.cur_random_projection:
            projection = random_projection(ctx, self.cur_projection_dim).to(keys.device) / math.sqrt(
                self.cur_projection_dim)
            keys, values = keys @ projection, values @ projection
        key_energy, value_energy = keys.pow(2).sum(dim=-1), values.pow(2).sum(dim=-1)
        return score_rows(ctx, lambda row, columns: self.row_scores(key_energy[row, :, columns],
                                                                     value_energy[row, :, columns]))

    def row_scores(self, key_energy: torch.Tensor, value_energy: torch.Tensor) -> torch.Tensor:
        """``[H_kv, n]`` scores of one row from its squared key and value norms ``[H_kv, n]``."""
        k2 = normalise_windows(key_energy, self.cur_local_window)
        v2 = normalise_windows(value_energy, self.cur_local_window)
        combined = {"kv_product": lambda: k2 * v2, "kv_avg": lambda: (k2 + v2) / 2,
                    "key": lambda: k2, "value": lambda: v2}[self.cur_leverage]()
        scores = normalise_windows(combined, 0)
        scores[:, : self.n_sink] = 1.0
        return scores


def random_projection(ctx: LayerInputs, columns: int) -> torch.Tensor:
    """``[d, columns]`` standard Gaussian draws of the layer (``layer_generator``), shared by every row."""
    return torch.randn(ctx.key.shape[-1], columns, generator=layer_generator(ctx))


def normalise_windows(energy: torch.Tensor, window: int) -> torch.Tensor:
    """``energy`` ``[H, n]`` divided by its sum over consecutive ``window``-token windows (the
    last one possibly shorter; ``window`` 0: the whole row); an all-zero window stays 0."""
    heads, length = energy.shape
    width = window or length
    padded = torch.nn.functional.pad(energy, (0, -length % width)).view(heads, -1, width)
    totals = padded.sum(dim=-1, keepdim=True)
    shares = padded / totals.clamp(min=torch.finfo(energy.dtype).tiny)
    return shares.flatten(start_dim=1)[:, :length]
