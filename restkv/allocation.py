"""How many tokens each row, layer and KV head keeps.

Each allocation is a registered part (``--allocation <name>``) that owns its options;
``allocate(ctx, scores)`` is called once per compressed layer with the scorer's
``[B, H_kv, N]`` scores and returns the kept count per row and KV head, protected tokens
(the recent window) included. Any scorer composes with any allocation:

* ``uniform``: every KV head keeps the row budget ``C``.
* ``pyramid`` (PyramidKV): layer ``l`` keeps ``B_l + W`` with ``B_l``
  falling linearly from ``n_max`` to ``n_min``; the layers sum exactly to ``N * B`` (largest
  remainder), or floor the step like the original release with ``--pyramid_reference_rounding``.
* ``adakv`` (AdaKV): within a layer, heads share ``H_kv * B`` candidates through a
  global top-k over their scores; every head keeps at least ``floor * B``.
* ``headkv`` (HeadKV): per-head budgets from a file of head importance scores,
  model-wide: per-layer totals vary, the model total is exactly ``N * H_kv * B``.

``B = C - W`` is the row's candidate budget (``W`` = its protected tokens). A row whose
visible tokens fit in its budget keeps all of them, whatever the allocation. The counts are
ragged per head; ``restkv.selection`` and the compressed cache pad only up to the layer's
largest head.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar, NamedTuple

import numpy as np
import torch

from restkv.config import kept_at_ratio
from restkv.context import ScoringContext
from restkv.head_scores import load_head_scores, read_head_score_file
from restkv.options import ConfigError, Options, option, register
from restkv.weights_file import check_shape, finite_floats, read_file_once


def layer_shape(ctx: ScoringContext) -> LayerShape:
    return LayerShape(ctx.layer_idx, ctx.num_layers, ctx.query.shape[1], ctx.num_kv_heads)


class LayerShape(NamedTuple):
    """Where a layer sits and how many heads it has (what allocations read besides the scores)."""

    layer_idx: int
    num_layers: int
    num_heads: int
    num_kv_heads: int


class RowShape(NamedTuple):
    """One row's budget: ``budget`` = C tokens per head (window included), ``window`` = W
    protected tokens, ``length`` = L visible tokens (of its longest head, when heads differ)."""

    row: int
    budget: int
    window: int
    length: int

    @property
    def candidate_budget(self) -> int:
        """``B = C - W``."""
        return self.budget - self.window

    @property
    def candidates(self) -> int:
        """``L - W`` tokens that compete."""
        return self.length - self.window


@dataclass(frozen=True)
class Allocation(Options):
    """Base of the allocations: spreads each row's budget over the KV heads of a layer.

    An allocation with ``model_wide = True`` needs every layer's scores at once: its layers
    compress after the whole prefill (``restkv.deferred``), which calls ``allocate_model``.
    """

    model_wide: ClassVar[bool] = False
    #: spreads a row's budget unequally over the KV heads of a layer (AdaKV, HeadKV): heads
    #: compressed apart (``restkv.recompress``) then share one row budget
    head_adaptive: ClassVar[bool] = False
    #: a boolean option of the allocation that also selects it (the release's ``--use_pyramid``)
    selected_by: ClassVar[str | None] = None
    #: may keep every token of a layer, or of some of its KV heads, by design under a budget that
    #: compresses the prompt (DuoAttention's retrieval heads, SimLayerKV's layers that are not lazy, a
    #: LU-KV curve's unpruned heads): a check that a compressing prefill compressed (the runners') can
    #: then ask only that restkv built the layers
    may_keep_whole: ClassVar[bool] = False

    def layer_budget(self, budget: int, seen: int, layer_idx: int, num_layers: int) -> int:
        """The tokens per KV head layer ``layer_idx`` keeps of a row whose budget is ``budget`` (window
        included) and which has seen ``seen`` tokens (the prompt so far, and the generated ones): the
        budget, unless the allocation sets each layer's own (``per_layer``). ``restkv.context.plan_layer``
        reads it, so that whether a layer is compressed at all follows the layer's budget."""
        return budget

    def allocate(self, ctx: ScoringContext, scores: torch.Tensor) -> torch.Tensor:
        """``[B, H_kv]`` tokens kept per row and KV head, protected tokens included."""
        protected = ctx.protected.sum(dim=-1)
        rows = []
        sizes = zip(ctx.budgets.tolist(), protected.tolist(), ctx.plan.visible_counts.tolist())
        for row, (budget, window, length) in enumerate(sizes):
            shape = RowShape(row, budget, window, length)
            if shape.candidate_budget >= shape.candidates:  # the row fits: keep every visible token
                rows.append(torch.full((ctx.num_kv_heads,), shape.candidates, dtype=torch.long))
            else:
                available = torch.full((ctx.num_kv_heads,), shape.candidates, dtype=torch.long)
                rows.append(self.candidate_counts(layer_shape(ctx), scores[row][:, ctx.candidates[row]], shape,
                                                  available).cpu())
        return torch.stack(rows).to(ctx.budgets.device) + protected[:, None]

    def candidate_counts(self, layer: LayerShape, scores: torch.Tensor, shape: RowShape,
                         available: torch.Tensor) -> torch.Tensor:
        """``[H_kv]`` candidate (non-protected) counts of a row that must be compressed.

        scores: ``[H_kv, n]`` the row's candidate scores per head; available: ``[H_kv]`` how many
        candidates each head has (when heads differ, as after an earlier compression, a head's
        row ends with ``-inf``); no count may exceed its head's. ``shape.candidate_budget`` is
        the average share (``B = C - W``).
        """
        raise NotImplementedError

    def allocate_model(self, contexts: dict[int, ScoringContext], scores: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Model-wide allocations: ``{layer: [B, H_kv] kept counts}`` from every compressed layer's
        context and scores (protected tokens included)."""
        raise NotImplementedError


@register("allocation")
@dataclass(frozen=True)
class Uniform(Allocation):
    """Every KV head keeps the row budget ``C``."""

    name = "uniform"

    def candidate_counts(self, layer, scores, shape, available):
        return torch.clamp(available, max=shape.candidate_budget)


@register("allocation")
@dataclass(frozen=True)
class Pyramid(Allocation):
    """PyramidKV's layer schedule (``pyramid_schedule``)."""

    name = "pyramid"
    selected_by = "use_pyramid"

    pyramid_beta: int = option(20, "PyramidKV: the last layer keeps about budget / beta candidate tokens",
                               minimum=1)
    pyramid_reference_rounding: bool = option(
        False, "PyramidKV: floor the per-layer step as the original release does (overshoots the total budget)"
    )
    use_pyramid: bool = option(
        False, "the original release's flag: PyramidKV's layer schedule without its middle (uniform) regime"
    )

    def candidate_counts(self, layer, scores, shape, available):
        schedule = pyramid_schedule(
            shape.budget,
            shape.window,
            shape.length,
            layer.num_layers,
            beta=self.pyramid_beta,
            reference_rounding=self.pyramid_reference_rounding,
            middle_regime=not self.use_pyramid,
        )
        return torch.clamp(available, max=schedule[layer.layer_idx])


@register("allocation")
@dataclass(frozen=True)
class PerLayerRatios(Uniform):
    """Each layer its own compression ratio (kvpress' PerLayerCompressionPress): layer ``l`` keeps
    ``floor(n (1 - r_l))`` of the ``n`` tokens its row has seen, window included, at most the run's
    budget (the largest any layer keeps, and the memory bound); a row within the budget is kept whole.
    Under ``--prefill_chunk_size`` and ``--decode_budget`` ``n`` counts every token seen so far, not
    only those the layer holds."""

    name = "per_layer"

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


@register("allocation")
@dataclass(frozen=True)
class LUKVAllocation(Allocation):
    """LU-KV's per-head budgets (arXiv 2602.08585) from a budget curve: ``--lukv_curve`` holds, for
    each compression ratio 1%..99%, every layer's and KV head's prune ratio (``[99, layers, KV
    heads]``, made offline by LU-KV's own tools for one model and one scorer). A row of ``L`` tokens
    with budget ``C`` reads the curve's row for ``round(100 (1 - C / L))%``; head ``h`` keeps
    ``(1 - p_h) L`` tokens, rounded so the layer keeps the rounded sum (largest remainders first),
    window and sinks included (kvpress' LUKVPress). The model never keeps more than ``C`` per head on
    average: a curve row that would (its prune ratios average below its ratio) is scaled down, the
    heads sharing the budget in proportion to their keep rates (``lukv_counts``)."""

    name = "lukv"
    head_adaptive = True
    may_keep_whole = True

    lukv_curve: str | None = option(
        None, "LU-KV: .npy budget curve [99, layers, KV heads] of prune ratios in [0, 1] (row r - 1: ratio r "
        "percent), made for this model and scorer (LU-KV's published curves: --method expected_attention "
        "--ea_epsilon 0.02 --n_sink 4 --window_size 1)", names_file=True)

    def __post_init__(self) -> None:
        if isinstance(self.lukv_curve, os.PathLike):
            object.__setattr__(self, "lukv_curve", os.fspath(self.lukv_curve))
        super().__post_init__()

    def validate(self) -> None:
        if self.lukv_curve is not None:
            lukv_curve(self.lukv_curve)

    def check(self, config) -> None:
        if self.lukv_curve is None:
            raise ConfigError("--allocation lukv reads each head's budget from a curve: give --lukv_curve FILE.npy")
        flags = config.rescoring_flags()
        if flags:
            raise ConfigError(f"--allocation lukv reads the curve's row of the prompt's compression ratio; "
                              f"{' and '.join(flags)} would compress the layers again at other ratios")

    def check_model(self, config, model) -> None:
        self.check_curve(model.num_layers, model.num_kv_heads)

    def check_curve(self, num_layers: int, num_kv_heads: int) -> torch.Tensor:
        """The curve, refused (naming the flag) unless it is made for ``num_layers`` x ``num_kv_heads``."""
        curve = lukv_curve(self.lukv_curve)
        check_shape("--lukv_curve", self.lukv_curve, "the curve", curve.shape, (99, num_layers, num_kv_heads))
        return curve

    def candidate_counts(self, layer, scores, shape, available):
        curve = self.check_curve(layer.num_layers, layer.num_kv_heads)
        index = min(max(round(100 * (1 - shape.budget / shape.length)) - 1, 0), 98)
        kept = lukv_counts(curve[index], shape.length, shape.budget, shape.window)[layer.layer_idx]
        return torch.minimum(kept - shape.window, available)


def lukv_counts(prune: torch.Tensor, length: int, budget: int, protected: int) -> torch.Tensor:
    """``[layers, KV heads]`` tokens each head keeps of a row of ``length`` tokens under LU-KV's curve
    row ``prune`` (prune ratios): ``(1 - p) length``, each layer keeping its rounded sum (largest
    remainders first; kvpress' LUKVPress), each head at least its ``protected`` tokens (and 1). Where
    that exceeds the model's budget (``budget`` per head), the heads keep their protected tokens and
    share the rest of the budget in proportion to their keep rates instead."""
    num_layers, num_heads = prune.shape
    least = max(1, protected)
    ideal = (1 - prune) * length
    counts = ideal.floor().long()
    for layer in range(num_layers):
        target = min(max(round(float(ideal[layer].sum())), num_heads), num_heads * length)
        remainder = target - int(counts[layer].sum())
        if remainder > 0:
            counts[layer, torch.topk(ideal[layer] - counts[layer], min(remainder, num_heads)).indices] += 1
    counts = counts.clamp(min=least, max=length)
    total = num_layers * num_heads * budget
    if int(counts.sum()) <= total:
        return counts
    weights = ideal.flatten().double()
    pool, room = total - num_layers * num_heads * least, length - least
    shares = _clamp_spreading_excess(weights / weights.sum() * pool, weights, float(room))
    return (_round_to_total(shares, pool, room) + least).view(num_layers, num_heads)


def lukv_curve(path: str) -> torch.Tensor:
    """``[99, layers, KV heads]`` float32 prune ratios of a LU-KV curve file, read once while it is
    unchanged (``ConfigError`` naming ``--lukv_curve`` when it is not one)."""
    return read_file_once(path, "--lukv_curve", _read_curve)


def _read_curve(path: str) -> torch.Tensor:
    try:
        curve = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:
        raise ValueError(f"not a .npy array ({error})") from None
    if not isinstance(curve, np.ndarray):
        curve.close()
        raise ValueError("not a .npy array (an .npz archive?)")
    if curve.dtype.kind not in "fiu":
        raise ValueError(f"holds {curve.dtype} values, not prune ratios")
    if curve.ndim != 3 or curve.shape[0] != 99:
        raise ValueError(f"expected [99, layers, KV heads] prune ratios, got {list(curve.shape)}")
    ratios = finite_floats("--lukv_curve", path, {"the curve": torch.from_numpy(curve.astype(np.float32))})["the curve"]
    if bool(((ratios < 0) | (ratios > 1)).any()):
        raise ValueError(f"prune ratios must lie in [0, 1]; the curve holds {float(ratios.min()):g} to "
                         f"{float(ratios.max()):g}")
    return ratios


@register("allocation")
@dataclass(frozen=True)
class AdaKVAllocation(Allocation):
    """AdaKV's head-adaptive budgets within a layer (``adakv_caps``)."""

    name = "adakv"
    head_adaptive = True

    floor: float = option(0.2, "AdaKV safeguard: every head keeps at least floor * (budget - window) candidates",
                          minimum=0, maximum=1)
    adakv_reference_allocation: bool = option(
        False, "AdaKV: the original rounding (head totals off by a few tokens, floor approximate)"
    )
    adakv_normalize: bool = option(
        True, "AdaKV: weight each head's scores by the share of its mass in its own top budget before ranking"
    )

    def candidate_counts(self, layer, scores, shape, available):
        return adakv_caps(
            scores,
            shape.candidate_budget,
            self.floor,
            normalize=self.adakv_normalize,
            reference=self.adakv_reference_allocation,
        )


@register("allocation")
@dataclass(frozen=True)
class HeadKVAllocation(Allocation):
    """HeadKV's per-head budgets from a head-score file, model-wide (``headkv_table``)."""

    name = "headkv"
    head_adaptive = True

    head_scores: str | None = option(
        None, "HeadKV: JSON file of per-head importance scores (python -m restkv.benchmarks.head_scores computes one)",
        names_file=True,
    )
    head_beta: float = option(1.01, "HeadKV: budget / head_beta candidates per head are pooled and redistributed",
                              minimum=1)
    head_temp: float = option(1.0, "HeadKV: temperature applied to the normalised head scores",
                              minimum=0, exclusive_minimum=True)
    headkv_window_outside: bool = option(
        False, "HeadKV: the reference runner's semantics, window kept on top of the head capacity"
    )

    def __post_init__(self) -> None:
        if isinstance(self.head_scores, os.PathLike):
            object.__setattr__(self, "head_scores", os.fspath(self.head_scores))
        super().__post_init__()

    def validate(self) -> None:
        if self.head_scores is not None:
            read_file_once(self.head_scores, "--head_scores", read_head_score_file)

    def check(self, config) -> None:
        if self.head_scores is None:
            raise ConfigError(
                "HeadKV allocation needs --head_scores FILE (per-head scores; compute one with python -m "
                "restkv.benchmarks.head_scores --model_path MODEL --out "
                "data/heads_score/MODEL_retrieval_reasoning_heads.json)"
            )

    def check_model(self, config, model) -> None:
        try:
            load_head_scores(self.head_scores, model.num_layers, model.num_heads)
        except ValueError as error:
            raise ConfigError(f"--head_scores: {error}") from None

    def candidate_counts(self, layer, scores, shape, available):
        path = os.path.abspath(self.head_scores)
        # The reference runner computes capacities from C and keeps the window on top.
        budget = shape.budget if self.headkv_window_outside else shape.candidate_budget
        table = headkv_table(
            path,
            os.path.getmtime(path),
            budget,
            shape.candidates,
            layer.num_layers,
            layer.num_heads,
            layer.num_kv_heads,
            self.head_beta,
            self.head_temp,
        )
        return torch.minimum(torch.tensor(table[layer.layer_idx], dtype=torch.long), available)


# ---------------------------------------------------------------- PyramidKV
@lru_cache(maxsize=256)
def pyramid_schedule(
    budget: int,
    window: int,
    length: int,
    num_layers: int,
    beta: int = 20,
    reference_rounding: bool = False,
    middle_regime: bool = True,
) -> tuple[int, ...]:
    """PyramidKV's candidate budget ``B_l`` of every layer.

    Parameters
    ----------
    budget: ``C`` tokens per head under a uniform allocation, window included.
    window: ``W`` protected tokens (kept on top of ``B_l``).
    length: ``L`` tokens of the row.
    beta: the last layer keeps about ``(C - W) / beta`` candidates.
    reference_rounding: floor the step like the original release (the total overshoots
        ``N * B``); otherwise a real-valued step with largest-remainder rounding, so the
        layers sum to exactly ``N * B``.
    middle_regime: PyramidKV's rule that rows with ``L < 2B`` keep the uniform ``B`` (the
        ReST-KV release's ``--use_pyramid`` has no such regime).

    Returns a non-increasing tuple of ``num_layers`` candidate counts, each at most ``L - W``.
    """
    candidates = budget - window
    n_min = candidates // beta
    n_max = 2 * candidates - n_min
    if n_max >= length - window:
        n_max = length - window
        n_min = 2 * candidates - n_max
    if (middle_regime and length < 2 * candidates) or num_layers == 1:
        return (candidates,) * num_layers
    if reference_rounding:
        step = (n_max - n_min) // (num_layers - 1)
        return tuple(n_max - layer * step for layer in range(num_layers))
    # B_l = n_max - l (n_max - n_min) / (N - 1) in exact integer arithmetic; the real values
    # sum to N B because n_max + n_min = 2B.
    spread, intervals = n_max - n_min, num_layers - 1
    numerators = [n_max * intervals - layer * spread for layer in range(num_layers)]
    counts = [value // intervals for value in numerators]
    remainders = [value % intervals for value in numerators]
    missing = num_layers * candidates - sum(counts)
    # Largest remainder first; ties go to the lower layer, which keeps the schedule monotone.
    for layer in sorted(range(num_layers), key=lambda i: (-remainders[i], i))[:missing]:
        counts[layer] += 1
    return tuple(counts)


# ---------------------------------------------------------------- AdaKV
def adakv_caps(
    scores: torch.Tensor, budget: int, floor: float, normalize: bool = True, reference: bool = False
) -> torch.Tensor:
    """AdaKV's candidate count per head of one row.

    Parameters
    ----------
    scores: ``[H_kv, n]`` scores of the row's candidates (``H_kv * budget`` of them or more); a
        head with fewer candidates ends its row with ``-inf``.
    budget: ``B`` candidates per head on average; the heads share ``H_kv * B``.
    floor: safeguard ``alpha``: every head keeps at least ``floor(alpha * B)`` (or all it has).
    normalize: weight head ``k``'s scores by (sum of its top-``B``) / (sum of all), as the
        KVCache-Factory / ReST-KV runs do, so heads with flat attention compete fairly.
    reference: the original rounding ``round((1 - alpha) n_k + floor)`` after a global top-
        ``H_kv B`` over all scores (totals off by a few tokens); otherwise each head's top
        ``floor`` is reserved and the rest goes to the global top of the remaining
        candidates, so the total is exactly ``H_kv * B`` and every head gets its floor.

    Returns ``[H_kv]`` long counts, each between the floor and the head's candidates. Ties in
    the global ranking go to the lower head, then the lower rank (deterministic).
    """
    num_heads, width = scores.shape
    reserved = int(floor * budget)
    ranked = torch.sort(scores.float(), dim=-1, descending=True, stable=True).values
    finite = torch.isfinite(ranked)
    ragged = not bool(finite.all())
    if normalize:
        real = ranked.masked_fill(~finite, 0.0) if ragged else ranked
        totals = real.sum(dim=-1, keepdim=True)
        share = real[:, :budget].sum(dim=-1, keepdim=True) / totals
        ranked = ranked * torch.where(totals != 0, share, torch.ones_like(share))
    available = finite.sum(dim=-1)
    if reference:
        won = _global_top(ranked, min(num_heads * budget, int(available.sum())))
        return torch.minimum(torch.round(won.float() * (1.0 - floor) + reserved).long(), available)
    if not ragged:
        return reserved + _global_top(ranked[:, reserved:], num_heads * (budget - reserved))
    held = torch.clamp(available, max=reserved)
    pool = ranked.masked_fill(torch.arange(width, device=ranked.device) < held[:, None], float("-inf"))
    count = min(num_heads * budget - int(held.sum()), int(torch.isfinite(pool).sum()))
    return held + _global_top(pool, count)


def _global_top(ranked: torch.Tensor, count: int) -> torch.Tensor:
    """How many of the ``count`` largest entries of ``ranked`` ``[H, n]`` each head holds."""
    num_heads, width = ranked.shape
    order = torch.sort(ranked.flatten(), descending=True, stable=True).indices[:count]
    return torch.bincount(order // width, minlength=num_heads)


# ---------------------------------------------------------------- HeadKV
@lru_cache(maxsize=64)
def headkv_table(
    path: str,
    mtime: float,
    budget: int,
    available: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    beta: float = 1.01,
    temperature: float = 1.0,
) -> tuple[tuple[int, ...], ...]:
    """HeadKV's candidate count of every (layer, KV head), model-wide.

    Head importance ``s`` (mean of each head's probe scores, normalised to sum 1, then
    ``s^T / sum s^T``) is summed over each query group; each KV head gets
    ``s * pool + base`` with ``pool = floor(B / beta) * N * H_kv`` and
    ``base = B - floor(B / beta)``. Counts above ``available`` are clamped and the excess is
    spread over the other heads in proportion to their scores; largest-remainder rounding
    makes the model total exactly ``N * H_kv * B``. ``mtime`` keys the cache, so a file
    rewritten in place is read again. Computed once per (file, budget, row length, model
    shape), not per layer.
    """
    importance = load_head_scores(path, num_layers, num_heads).double()
    importance = importance / importance.sum()
    importance = importance**temperature
    importance = importance / importance.sum()
    per_kv_head = importance.view(num_layers, num_kv_heads, num_heads // num_kv_heads).sum(dim=-1).flatten()
    pooled = int(budget // beta)
    ideal = per_kv_head * (pooled * num_layers * num_kv_heads) + (budget - pooled)
    total = num_layers * num_kv_heads * budget
    counts = _round_to_total(_clamp_spreading_excess(ideal, per_kv_head, float(available)), total, available)
    return tuple(tuple(row) for row in counts.view(num_layers, num_kv_heads).tolist())


def _clamp_spreading_excess(ideal: torch.Tensor, weights: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamp ``ideal`` at ``limit`` and give what was cut to the unclamped entries, in
    proportion to ``weights`` (uniformly if they are all zero), until nothing exceeds it."""
    values = ideal.clone()
    while bool((values > limit).any()):
        excess = float((values - limit).clamp(min=0).sum())
        values = values.clamp(max=limit)
        free = values < limit
        if not bool(free.any()):
            break
        share = torch.where(free, weights, torch.zeros_like(weights))
        share = share / share.sum() if float(share.sum()) > 0 else free.double() / float(free.sum())
        values = values + excess * share
    return values


def _round_to_total(values: torch.Tensor, total: int, limit: int) -> torch.Tensor:
    """Integers near ``values`` that sum to ``total`` (largest remainder; ties to the lower
    index), none above ``limit``."""
    counts = values.floor().long().clamp(max=limit)
    missing = min(total - int(counts.sum()), int((counts < limit).sum()))
    if missing > 0:
        # Remainders equal up to float noise count as ties (so the lower index wins, predictably).
        remainders = (values - counts.double()).round(decimals=9)
        remainders = torch.where(counts < limit, remainders, torch.full_like(values, -1.0))
        order = torch.sort(remainders, descending=True, stable=True).indices[:missing]
        counts[order] += 1
    return counts


# ---------------------------------------------------------------- one ranking for many heads
@register("allocation")
@dataclass(frozen=True)
class LayerRanked(Allocation):
    """The KV heads of a layer share its ``H_kv * B`` candidates by one ranking of their scores
    (AdaKV without its floor or normalisation; KVzip's ``--kvzip_layerwise``)."""

    name = "layer_ranked"
    head_adaptive = True

    def candidate_counts(self, layer, scores, shape, available):
        return adakv_caps(scores, shape.candidate_budget, 0.0, normalize=False)


@register("allocation")
@dataclass(frozen=True)
class ModelRanked(Allocation):
    """Every compressed layer and KV head shares the model's budget by one ranking of their
    scores (KVzip): per row, the top ``sum over layers of H_kv * B`` candidates across the model,
    each (layer, head) keeping the ones it won. Scores must be comparable across layers.
    Ties go to the lower layer, head and position."""

    name = "model_ranked"
    head_adaptive = True
    model_wide = True

    def reserved(self, candidate_budget: int) -> int:
        """Candidates every (layer, KV head) keeps before the model-wide ranking (none here)."""
        return 0

    def allocate(self, ctx: ScoringContext, scores: torch.Tensor) -> torch.Tensor:
        """A single layer ranks its heads alone (the model of one layer)."""
        return self.allocate_model({ctx.layer_idx: ctx}, {ctx.layer_idx: scores})[ctx.layer_idx]

    def allocate_model(self, contexts, scores):
        layers = sorted(contexts)
        first = contexts[layers[0]]
        keeps = {layer: torch.zeros(first.valid.shape[0], first.num_kv_heads, dtype=torch.long) for layer in layers}
        for row in range(first.valid.shape[0]):
            competing, total = [], 0
            for layer in layers:
                ctx = contexts[layer]
                protected = int(ctx.protected[row].sum())
                shape = RowShape(row, int(ctx.budgets[row]), protected, int(ctx.plan.visible_counts[row]))
                keeps[layer][row] = protected
                if shape.candidate_budget >= shape.candidates:  # the row fits in this layer
                    keeps[layer][row] += shape.candidates
                    continue
                part = scores[layer][row][:, ctx.candidates[row]].float().cpu()
                reserved = min(self.reserved(shape.candidate_budget), part.shape[1])
                if reserved:  # each head's own top candidates win first
                    top = torch.sort(part, dim=-1, descending=True, stable=True).indices[:, :reserved]
                    part = part.scatter(1, top, float("inf"))
                competing.append((layer, part))
                total += ctx.num_kv_heads * shape.candidate_budget
            if not competing:
                continue
            flat = torch.cat([part.flatten() for _, part in competing])
            owner = torch.cat([torch.full((part.numel(),), index, dtype=torch.long)
                               for index, (_, part) in enumerate(competing)])
            head = torch.cat([torch.arange(part.shape[0]).repeat_interleave(part.shape[1]) for _, part in competing])
            won = torch.sort(flat, descending=True, stable=True).indices[:total]
            for index, (layer, part) in enumerate(competing):
                mine = won[owner[won] == index]
                keeps[layer][row] += torch.bincount(head[mine], minlength=part.shape[0])
        device = first.budgets.device
        return {layer: keep.to(device) for layer, keep in keeps.items()}


@register("allocation")
@dataclass(frozen=True)
class LaProxAllocation(ModelRanked):
    """LaProx's model-wide selection: ``model_ranked`` over layer-normalised scores, with an optional
    per-head floor (an AdaKV-style safeguard that the paper, as read, does not have)."""

    name = "laprox"

    laprox_floor: float = option(
        0.0, "LaProx: every (layer, KV head) keeps at least floor * (budget - window) candidates before the "
        "model-wide ranking (0 = off: the paper, as read, has no floor)", minimum=0, maximum=1,
    )

    def reserved(self, candidate_budget: int) -> int:
        return int(self.laprox_floor * candidate_budget)
