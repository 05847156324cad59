"""LaProx (Mai & Kim, arXiv 2605.07234): eviction as an approximation of the layer's output
product, with one selection across the whole model.

For the observation queries a layer's output is ``O = sum_h A_h V_{k(h)} W_o^h^T``, a product
whose inner index runs over (query head, token). Keeping a token keeps its column of the
window attention and its row of projected values; the column-row weight of approximate
matrix multiplication ranks it. As an independent re-implementation from the paper reads it (no
code is public), per query head ``h`` and candidate ``j``:

    p_{h,j} = ||A_{h, window, j}||_2 * ||W_o^h v_j||_2          (not squared)

with ``||W_o^h v||^2 = v^T Gamma_h v`` (the head's Gram matrix, so ``V W_o`` is never formed);
``--gqa_score_agg`` (default mean) reduces a query group to its KV head, average pooling
with kernel 7 smooths it (``--pooling``/``--kernel_size``), and each layer's scores are divided
by their sum over the layer's KV heads and candidates (``--laprox_norm layer_sum``), so that
one ranking of every (layer, KV head, token) keeps ``layers x KV heads x (budget - window)``
candidates in all (``--laprox_alloc global``; the recent window stays in every head). Each
layer and head keeps what it won, ragged per layer and head.

Variants (from an earlier reconstruction, written before that re-implementation was known, and
the paper's ablations):

* ``--laprox_cross_heads``: ``||sum_{h in group} a_{h,j} (W_o^h v_j)^T||_F^2``, the squared group
  term with the cross-head Gram blocks ``(a_h . a_h') v^T W_o^h^T W_o^h' v`` (no group reduction);
* ``--laprox_norm none`` (the paper's "raw" ablation) or ``output_energy`` (divide by the
  layer's ``||O||_F^2`` over the window queries, the earlier reconstruction's);
* ``--laprox_floor F``: every (layer, head) keeps ``F x (budget - window)`` candidates first
  (an AdaKV-style safeguard, 0.1 in the earlier reconstruction; 0 = off, the paper as read);
* ``--laprox_alloc layer`` (Table 5: the heads of each layer share its budget) or ``uniform``
  (Table 6: every head keeps the budget).

Memory: with ``--laprox_alloc global`` every layer's scores are needed before any layer is
compressed, so layers compress after the whole prefill (``restkv.integrations.transformers.deferred``): the peak holds
the uncompressed prefill's K/V of every layer (what an uncompressed prefill holds) plus, per
layer, its last ``window_size`` queries (``[B, H, W, d]``) and its output projection reference;
the scoring pass adds one layer at a time its window attention (``[B, H, W, L]`` float32),
its scores (``[B, H_kv, L]`` float32, all layers' alive together: ``layers x H_kv x L`` floats
per row) and chunked Gram products (at most ``CPU_CHUNK_ELEMENTS`` floats on the CPU). The
two other allocations compress each layer inside its own forward, like SnapKV.

Not recovered from the paper: the exact GQA formula, sink protection, whether the window
counts in the budget (here: it does, as for SnapKV), pooling padding (zeros counted, as the
other pooled scorers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import ConfigError, option, redeclared, register
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import PooledScores
from restkv.scoring.output_space import column_chunks, group_grams, head_grams, output_weight

LAPROX_NORMS = ("layer_sum", "none", "output_energy")
LAPROX_ALLOCATIONS = {"global": "laprox", "layer": "layer_ranked", "uniform": "uniform"}


@register("method")
@dataclass(frozen=True)
class LaProx(PooledScores):
    name = "laprox"
    reference = "LaProx: Mai & Kim, arXiv 2605.07234"
    allocation = "laprox"

    kernel_size: int = redeclared(PooledScores, "kernel_size", 7)  # LaProx's App. A
    laprox_cross_heads: bool = option(
        False, "LaProx: score the squared group term with cross-head Gram blocks instead of the per-head column "
        "norm x projected-value norm, group-reduced (not the paper's form)"
    )
    laprox_norm: str = option(
        "layer_sum", "LaProx: divide each layer's scores by their sum (layer_sum), by the layer's window output "
        "energy ||O||_F^2 (output_energy), or not at all (none)", LAPROX_NORMS,
    )
    laprox_alloc: str = option(
        "global", "LaProx: one ranking across layers and heads (global), across the heads of each layer (layer), or "
        "the budget per head (uniform)", tuple(LAPROX_ALLOCATIONS),
    )

    def own_allocation(self) -> str:
        return LAPROX_ALLOCATIONS[self.laprox_alloc]

    def check(self, config) -> None:
        super().check(config)
        if config.run.observation == "reconstruction":
            raise ConfigError(
                "--method laprox scores with each window query's own attention row (the column norm "
                "||A_window,j||), which --observation reconstruction does not keep (it accumulates reductions over "
                "its queries); use --observation window"
            )

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        if ctx.o_proj_weight is None:
            raise ValueError("LaProx scores in output space: pass the layer's o_proj_weight ([hidden, heads * "
                             "head_dim]) to compress_kv")
        weights = ctx.window_attention()  # [B, H, w, N]
        if self.laprox_cross_heads:
            scores = self._group_energy(ctx, weights)
        else:
            per_head = weights.norm(dim=2) * self._projected_value_norms(ctx)
            scores = self.reduce(ctx, per_head)
        scores = self.smooth(ctx, scores)
        if self.laprox_norm == "layer_sum":
            mass = scores.masked_fill(~ctx.candidates[:, None, :], 0.0).sum(dim=(1, 2))
        elif self.laprox_norm == "output_energy":
            mass = _window_output_energy(ctx, weights)
        else:
            return scores
        return scores / mass.clamp(min=torch.finfo(torch.float32).tiny)[:, None, None]

    @staticmethod
    def _projected_value_norms(ctx: LayerInputs) -> torch.Tensor:
        """``[B, H, N]`` ``||W_o^h v_{k(h), j}||`` for every query head."""
        grams = head_grams(ctx)  # [H_kv, G, d, d]
        values = ctx.value.float()
        batch, num_kv_heads, length, dim = values.shape
        groups = grams.shape[1]
        norms = values.new_empty(batch, num_kv_heads, groups, length)
        for columns in column_chunks(length, groups * dim, values.device):
            chunk = values[:, :, None, columns]  # [B, H_kv, 1, n, d]
            norms[..., columns] = ((chunk @ grams[None]) * chunk).sum(dim=-1)
        return norms.clamp(min=0).sqrt().flatten(1, 2)

    @staticmethod
    def _group_energy(ctx: LayerInputs, weights: torch.Tensor) -> torch.Tensor:
        """``[B, H_kv, N]`` ``sum_{h,h'} (a_h . a_h') v^T W_o^h^T W_o^h' v`` over each query group."""
        values = ctx.value.float()
        batch, num_kv_heads, length, dim = values.shape
        groups = weights.shape[1] // num_kv_heads
        grams = group_grams(ctx).view(num_kv_heads, groups, dim, groups, dim)
        columns_of = weights.view(batch, num_kv_heads, groups, weights.shape[2], length)
        energy = values.new_empty(batch, num_kv_heads, length)
        for columns in column_chunks(length, groups * groups * dim, values.device):
            chunk = values[:, :, columns]  # [B, H_kv, n, d]
            projected = torch.einsum("bknd,kgdhe,bkne->bkghn", chunk, grams, chunk)
            overlaps = torch.einsum("bkgwn,bkhwn->bkghn", columns_of[..., columns], columns_of[..., columns])
            energy[..., columns] = (projected * overlaps).sum(dim=(2, 3))
        return energy.clamp(min=0)


def _window_output_energy(ctx: LayerInputs, weights: torch.Tensor) -> torch.Tensor:
    """``[B]`` ``||O||_F^2`` of the layer's output for the window queries (every key they see)."""
    batch, num_heads, window, length = weights.shape
    groups = num_heads // ctx.num_kv_heads
    grouped = weights.view(batch, ctx.num_kv_heads, groups * window, length)
    heads = (grouped @ ctx.value.float()).view(batch, num_heads, window, -1)  # [B, H, w, d]
    output = torch.einsum("bhwd,chd->bwc", heads, output_weight(ctx))
    return output.square().sum(dim=(1, 2))
