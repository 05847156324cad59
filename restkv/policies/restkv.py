"""ReST-KV (An et al., ICLR 2026, arXiv 2605.08840): output-reconstruction scoring with
spatial-temporal smoothing.

Deleting key ``j`` from a head whose attention output is ``o`` changes that output by
``(a_j / (1 - a_j)) * (v_j - o)`` (the other weights renormalise), so the layer output moves
by ``r_j * W_o^h (v_j - o)`` with the odds ratio ``r_j = a_j / (1 - a_j)``. The score of a
past token is the norm of that change:

* ``--metric_mode after`` (paper): aggregate the window attention over the window queries
  first (``--use_ema --alpha``, or the mean), then ``score = r(ā) * ‖W_o^h (ō - v_j)‖^tau``
  with ``ō`` the aggregated-attention mixture of the past values
  (``--restkv_mean_output full``: of all values).
* ``--metric_mode before``: the exact change per window query, then aggregated;
  ``--use_norm`` divides each query's term by ``‖W_o^h o_i‖``.
* ``--no-use_wo`` measures the gap in value space (and, as the release does, without tau).

Query heads are reduced to one score per KV head (``--gqa_score_agg``, default mean;
``--restkv_gqa vector`` scores the norm of the group's summed change instead), then
smoothed (``--pooling``, default ``adaptive``, see ``restkv.scoring.adaptive_pooling``). Defaults are
the paper's: ``--use_wo --use_ema --alpha 0.3 --metric_mode after --pooling adaptive
--scale 2000``, window 32, kernel 5.

Output-space norms never form ``[N, hidden]`` tensors: ``‖W_o^h x‖² = xᵀ Γ_h x`` with the
per-head Gram matrix ``Γ_h = W_o^hᵀ W_o^h`` (d x d).

Ablations (to rerun the paper's tables): ``--indicator attn`` (aggregated attention, SnapKV's
ranking), ``attn_v`` (times ``‖v_j‖``), ``random`` (the ``random`` control's scores, not
smoothed), ``reconstruction`` (the above); ``--temporal none|mean|ema|inv_ema`` overrides
``--use_ema``; ``--pooling none|avgpool|maxpool|adaptive``. The switches apply to every
indicator; the release's ablation rows for ``attn``/``attn_v`` always used the window mean
(same ranking as its sum) and avgpool 5, i.e. ``--temporal mean --pooling avgpool``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import ConfigError, option, redeclared, register
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import PooledScores
from restkv.policies.random_control import random_scores
from restkv.scoring.output_space import column_chunks, group_grams, head_factors, head_grams
from restkv.scoring.temporal import TEMPORAL_MODES, aggregate_queries

#: attention weights are clamped to 1 - ODDS_EPSILON before the odds ratio (no inf / NaN)
ODDS_EPSILON = 1e-6
#: smallest output norm divided by under --use_norm
MIN_OUTPUT_NORM = 1e-12


METRIC_MODES = ("after", "before")
MEAN_OUTPUTS = ("past_only", "full")
RESTKV_GQA = ("mean", "vector")
INDICATORS = ("reconstruction", "attn", "attn_v", "random")


@register("method")
@dataclass(frozen=True)
class RestKV(PooledScores):
    name = "restkv"
    reference = "ReST-KV: An et al., ICLR 2026, arXiv 2605.08840"

    pooling: str = redeclared(PooledScores, "pooling", "adaptive")
    use_wo: bool = option(
        True, "ReST-KV: measure the output change through the layer's W_o (--no-use_wo: in value space, without --tau)"
    )
    use_ema: bool = option(
        True, "ReST-KV: aggregate the window queries with an EMA of weight --alpha (--no-use_ema: their mean)"
    )
    alpha: float = option(0.3, "ReST-KV: EMA weight of the newest window query", minimum=0, maximum=1)
    metric_mode: str = option(
        "after",
        "ReST-KV: 'after' aggregates the window attention, then scores once (the paper); 'before' scores every "
        "window query, then aggregates",
        METRIC_MODES,
    )
    tau: float = option(1.0, "ReST-KV: exponent of the output-space gap (--use_wo with --metric_mode after)",
                        minimum=0, exclusive_minimum=True)
    use_norm: bool = option(
        False, "ReST-KV --metric_mode before: divide each query's term by its output norm (after mode ignores it)"
    )
    restkv_mean_output: str = option(
        "past_only",
        "ReST-KV after mode: the mean output mixes the past values only (the release) or every value",
        MEAN_OUTPUTS,
    )
    restkv_gqa: str = option(
        "mean",
        "ReST-KV under GQA: reduce per-query-head scores with --gqa_score_agg, or score the norm of the query "
        "group's summed output change (vector)",
        RESTKV_GQA,
    )
    indicator: str = option(
        "reconstruction",
        "ReST-KV ablation: token importance from the output reconstruction, the window attention (attn), attention "
        "times value norm (attn_v) or random scores",
        INDICATORS,
    )
    temporal: str | None = option(
        None, "ReST-KV ablation: aggregation over the window queries; default: ema with --use_ema, else mean",
        TEMPORAL_MODES,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.temporal is None:  # derived, so that replace(use_ema=...) derives it again
            object.__setattr__(self, "temporal", "ema" if self.use_ema else "mean")

    def validate(self) -> None:
        super().validate()
        if self.restkv_gqa == "vector":
            if self.indicator != "reconstruction" or self.metric_mode != "after":
                raise ConfigError(
                    "--restkv_gqa vector scores the reconstruction indicator in --metric_mode after; got "
                    f"--indicator {self.indicator} --metric_mode {self.metric_mode}"
                )
            if self.tau != 1:
                raise ConfigError(f"--restkv_gqa vector takes no exponent; use --tau 1 (got {self.tau})")

    def check(self, config) -> None:
        super().check(config)
        if config.run.observation == "reconstruction" and self.indicator == "reconstruction" and (
            self.metric_mode == "before"
        ):
            raise ConfigError(
                "--metric_mode before scores each observation query's own output, which --observation "
                "reconstruction does not keep; use --metric_mode after"
            )

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        if self.indicator == "random":
            return random_scores(ctx)
        if self.indicator == "reconstruction":
            if self.restkv_gqa == "vector":
                per_kv_head = group_change_norms(ctx, self)
            elif self.metric_mode == "after":
                per_kv_head = self.reduce(ctx, reconstruction_after(ctx, self))
            else:
                per_kv_head = self.reduce(ctx, reconstruction_before(ctx, self))
        else:
            attention = ctx.observation.aggregate(self.temporal, self.alpha)
            if self.indicator == "attn_v":
                attention = _per_query_head(_grouped(attention, ctx) * ctx.value.float().norm(dim=-1)[:, :, None])
            per_kv_head = self.reduce(ctx, attention)
        return self.smooth(ctx, per_kv_head)


def reconstruction_after(ctx: LayerInputs, options: RestKV) -> torch.Tensor:
    """``[B, H, N]``: ``r(ā_j) * ‖W_o^h (ō - v_j)‖^tau`` per query head (``--metric_mode after``).

    With ``W_o``, the gaps are ``‖R_h ō - R_h v_j‖`` (``R_h``: a square factor of the head's Gram
    matrix, ``head_factors``): every value is projected for the whole query group by one product,
    and the difference is taken after the projection, so no ``[G, N, d]`` difference is formed
    before it."""
    mean_attention, mean_output = _aggregated_attention_and_output(ctx, options)
    values = ctx.value.float()
    batch, num_kv_heads, length, dim = values.shape
    groups = mean_output.shape[2]
    gaps = values.new_empty(batch, num_kv_heads, groups, length)
    if options.use_wo:
        factors = head_factors(ctx)  # [H_kv, G, d, d]
        offsets = torch.einsum("kgij,bkgj->bkgi", factors, mean_output).neg_().reshape(batch * num_kv_heads, 1, -1)
        projection = factors.permute(0, 3, 1, 2).reshape(1, num_kv_heads, dim, groups * dim)
        projection = projection.expand(batch, -1, -1, -1).reshape(batch * num_kv_heads, dim, groups * dim)
        flat_values = values.reshape(batch * num_kv_heads, length, dim)
    for columns in column_chunks(length, groups * dim, values.device):
        if options.use_wo:  # R_h v_j - R_h ō for every head of the group in one product
            differences = torch.baddbmm(offsets, flat_values[:, columns], projection)
            differences = differences.view(batch, num_kv_heads, -1, groups, dim)
        else:
            differences = values[:, :, columns, None, :] - mean_output[:, :, None]
        gaps[..., columns] = torch.linalg.vector_norm(differences, dim=-1).transpose(-1, -2)
    if options.use_wo and options.tau != 1:
        gaps = gaps.pow(options.tau)
    return _odds(mean_attention) * _per_query_head(gaps)


def group_change_norms(ctx: LayerInputs, options: RestKV) -> torch.Tensor:
    """``[B, H_kv, N]``: ``‖Σ_{h in group} r_h W_o^h (v_j - ō_h)‖`` (``--restkv_gqa vector``).

    The exact layer-output change when token ``j`` leaves the KV head (all ``G`` query heads
    lose it), through the group's Gram matrix ``[G*d, G*d]`` (cross-head blocks included).
    """
    mean_attention, mean_output = _aggregated_attention_and_output(ctx, options)
    odds = _grouped(_odds(mean_attention), ctx)
    values = ctx.value.float()
    batch, num_kv_heads, length, _ = values.shape
    gram = group_grams(ctx) if options.use_wo else None
    norms = torch.empty(batch, num_kv_heads, length, dtype=torch.float32, device=values.device)
    for columns in column_chunks(length, mean_output.numel(), values.device):
        changes = odds[..., columns, None] * (values[:, :, None, columns, :] - mean_output[:, :, :, None, :])
        if gram is None:  # value space: every W_o^h is the identity
            norms[..., columns] = changes.sum(dim=2).norm(dim=-1)
        else:
            stacked = changes.permute(0, 1, 3, 2, 4).reshape(batch, num_kv_heads, -1, gram.shape[-1])
            norms[..., columns] = _projected_norms(stacked, gram[None])
    return norms


def reconstruction_before(ctx: LayerInputs, options: RestKV) -> torch.Tensor:
    """``[B, H, N]``: ``Agg_i r(A_ij) * ‖W_o^h (o_i - v_j)‖`` per query head (``--metric_mode before``).

    ``o_i`` is query ``i``'s true attention output over every key. The squared norms are
    expanded as ``o Γ o - 2 (Γ o)·v + v Γ v`` (a ``[w, d] x [d, N]`` product per head); the
    most-attended key of each query, where ``o_i ≈ v_j`` makes that expansion cancel, is
    recomputed directly.
    """
    weights = ctx.window_attention().clamp(max=1.0 - ODDS_EPSILON)
    batch, num_heads, window, length = weights.shape
    num_kv_heads, head_dim = ctx.num_kv_heads, ctx.value.shape[-1]
    groups = num_heads // num_kv_heads
    values = ctx.value.float()
    gram = head_grams(ctx) if options.use_wo else None

    outputs = torch.matmul(weights.reshape(batch, num_kv_heads, groups * window, length), values)
    outputs = outputs.view(batch, num_kv_heads, groups, window, head_dim)
    projected_outputs = outputs if gram is None else outputs @ gram
    output_sq = (projected_outputs * outputs).sum(dim=-1)
    cross = torch.matmul(
        projected_outputs.reshape(batch, num_kv_heads, groups * window, head_dim), values.transpose(-1, -2)
    ).view(batch, num_kv_heads, groups, window, length)
    value_sq = torch.empty(batch, num_kv_heads, groups, length, dtype=torch.float32, device=values.device)
    for columns in column_chunks(length, value_sq[..., 0].numel() * head_dim, values.device):
        value_sq[..., columns] = _projected_squared_norms(values[:, :, None, columns, :], gram)
    squared = output_sq[..., None] - 2 * cross + value_sq[:, :, :, None, :]

    most_attended = _grouped(weights.argmax(dim=-1), ctx)  # [B, H_kv, G, w]
    nearest_values = values[:, :, None].expand(-1, -1, groups, -1, -1).gather(
        3, most_attended[..., None].expand(-1, -1, -1, -1, head_dim)
    )
    exact = _projected_squared_norms(outputs - nearest_values, gram)
    squared = squared.scatter(-1, most_attended[..., None], exact[..., None])

    terms = _odds(weights) * _per_query_head(squared.clamp(min=0).sqrt())
    if options.use_norm:
        output_norms = output_sq.clamp(min=0).sqrt().clamp(min=MIN_OUTPUT_NORM)
        terms = terms / _per_query_head(output_norms)[..., None]
    return aggregate_queries(terms, options.temporal, options.alpha)


def _aggregated_attention_and_output(ctx: LayerInputs, options: RestKV) -> tuple[torch.Tensor, torch.Tensor]:
    """``ā`` ``[B, H, N]`` (clamped below 1) and ``ō`` ``[B, H_kv, G, d]``, the ``ā``-weighted
    sum of the past values (``--restkv_mean_output past_only``, the release) or of all values.

    ``ō`` uses the clamped weights so that a one-hot head keeps a finite, top-ranked score:
    ``r * ‖ō - v_j‖`` then tends to ``‖v_j - ō^(-j)‖`` instead of ``inf * 0``.
    """
    mean_attention = ctx.observation.aggregate(options.temporal, options.alpha)
    mean_attention = mean_attention.clamp(max=1.0 - ODDS_EPSILON)
    mixing = mean_attention
    if options.restkv_mean_output == "past_only":
        mixing = mean_attention * ctx.candidates[:, None, :]
    mean_output = torch.matmul(_grouped(mixing, ctx), ctx.value.float())
    return mean_attention, mean_output


def _odds(weights: torch.Tensor) -> torch.Tensor:
    """``a / (1 - a)`` of weights already clamped below 1."""
    return weights / (1.0 - weights)


def _projected_norms(vectors: torch.Tensor, gram: torch.Tensor | None) -> torch.Tensor:
    """``‖W_o x‖ = sqrt(xᵀ Γ x)`` over the last dimension (``gram=None``: the plain norm)."""
    if gram is None:
        return vectors.norm(dim=-1)
    return _projected_squared_norms(vectors, gram).sqrt()


def _projected_squared_norms(vectors: torch.Tensor, gram: torch.Tensor | None) -> torch.Tensor:
    """``xᵀ Γ x`` over the last dimension, never negative (``gram=None``: ``‖x‖²``)."""
    if gram is None:
        return vectors.square().sum(dim=-1)
    return ((vectors @ gram) * vectors).sum(dim=-1).clamp(min=0)


def _grouped(per_query_head: torch.Tensor, ctx: LayerInputs) -> torch.Tensor:
    """``[B, H, ...]`` -> ``[B, H_kv, G, ...]`` (query head ``h`` reads KV head ``h // G``)."""
    batch, num_heads = per_query_head.shape[:2]
    return per_query_head.view(batch, ctx.num_kv_heads, num_heads // ctx.num_kv_heads, *per_query_head.shape[2:])


def _per_query_head(grouped: torch.Tensor) -> torch.Tensor:
    """``[B, H_kv, G, ...]`` -> ``[B, H, ...]``."""
    return grouped.flatten(1, 2)
