"""The queries that score a layer's prompt tokens (``--observation``), reduced to what scorers read.

A scorer asks its layer's observation for a few reductions of the attention that the
observation queries give the prompt's keys: the sum, mean or maximum over the queries,
their temporal aggregate (ReST-KV), the newest query's row (TOVA), the drift of the
attended positions (ReST-KV's adaptive pooling), and a sample of the queries themselves
(the ResKV validation proxy). Two observations implement them:

* ``WindowObservation`` (``--observation window``, the default): the last ``window_size``
  prompt queries, causal among themselves. What SnapKV and its relatives use; exact
  reductions of the window attention.
* ``ReconstructionObservation`` (``--observation reconstruction``, KVzip's idea): after the
  context's prefill, the model is asked to repeat the context and every query of the
  repetition observes the context (``restkv.integrations.transformers.deferred``). A question asked later resembles
  these queries far more than it resembles the context's own last tokens, so scores that
  come from them keep what a question will need. The reductions are accumulated chunk by
  chunk (``ReconstructionStats``), so no ``queries x context`` matrix is ever held at
  once. The queries have no recency order relative to a question, so temporal aggregation
  is their mean.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from restkv.scoring.temporal import aggregate_queries
from restkv.scoring.window import window_attention


class ObservedLayer(Protocol):
    """What a window observation reads of its layer (``restkv.pipeline.plan.LayerInputs`` has it)."""

    query: torch.Tensor
    key: torch.Tensor
    plan: Any  # restkv.pipeline.plan.LayerPlan: valid, window_size, sliding_window
    scaling: float
    softcap: float | None


@dataclass(frozen=True)
class _Observed:
    """The fields of an ``ObservedLayer`` an observation keeps: not the layer's context itself,
    which holds the observation (a reference cycle would keep every layer's queries, keys and
    attention alive until the garbage collector runs, well past the layer's compression)."""

    query: torch.Tensor
    key: torch.Tensor
    plan: Any
    scaling: float
    softcap: float | None


class WindowObservation:
    """The last ``window_size`` prompt queries of a layer (see the module docstring)."""

    def __init__(self, ctx: ObservedLayer) -> None:
        self.ctx = _Observed(ctx.query, ctx.key, ctx.plan, ctx.scaling, ctx.softcap)
        self._attention: dict[int, torch.Tensor] = {}

    def attention(self, num_queries: int | None = None) -> torch.Tensor:
        """``[B, H, w, N]`` float32 attention of the last ``w`` queries (default: the window) over
        every key they really see (real, causal, inside the sliding window), as the model
        computes it. Computed once per ``w`` and shared by every part of the layer."""
        ctx = self.ctx
        w = ctx.plan.window_size if num_queries is None else num_queries
        if w not in self._attention:
            self._attention[w] = window_attention(
                ctx.query, ctx.key, ctx.plan.valid, w, ctx.scaling, ctx.softcap, ctx.plan.sliding_window
            )
        return self._attention[w]

    def total(self) -> torch.Tensor:
        """``[B, H, N]`` attention summed over the observation queries."""
        return self.attention().sum(dim=2)

    def mean(self) -> torch.Tensor:
        """``[B, H, N]`` attention averaged over the observation queries."""
        return self.attention().mean(dim=2)

    def maximum(self) -> torch.Tensor:
        """``[B, H, N]`` the largest attention any observation query gives each key."""
        return self.attention().amax(dim=2)

    def aggregate(self, mode: str, alpha: float) -> torch.Tensor:
        """``[B, H, N]`` temporal aggregate over the queries, oldest first (``restkv.scoring.temporal``)."""
        return aggregate_queries(self.attention(), mode, alpha)

    def last(self) -> torch.Tensor:
        """``[B, H, N]`` the newest query's attention."""
        return self.attention(1)[:, :, 0, :]

    def shift_positions(self, row: int, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query head, the summed positions of each half's top-``top`` attended keys and the
        number of (query, position) pairs summed: ``(early, late)`` ``[H, 2]`` int64 (sum, count)
        for the first ``w // 2`` queries and the rest (ReST-KV's drift statistic)."""
        return top_position_sums(self.attention()[row], self.ctx.plan.valid[row], top)

    def queries(self, row: int, count: int) -> torch.Tensor:
        """``[H, count, d]`` the last ``count`` prompt queries of ``row`` (the ResKV validation proxy)."""
        query = self.ctx.query
        return query[row, :, query.shape[2] - count :]

    @property
    def query_count(self) -> int:
        """How many queries the validation proxy can draw from."""
        return self.ctx.query.shape[2]

    @property
    def sees_everything(self) -> bool:
        """False: each window query sees the keys up to its own position (causal)."""
        return False


def top_position_sums(weights: torch.Tensor, valid: torch.Tensor, top: int,
                      first_half: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(early, late)``, each ``[H, 2]``: the summed positions of every query's ``top`` most
    attended keys and how many positions were summed, for the queries of the first half and the
    rest (``first_half`` ``[q]`` bool; default: the first ``q // 2`` of ``weights`` ``[H, q, N]``)."""
    if weights.shape[1] == 0:
        empty = torch.zeros(weights.shape[0], 2, dtype=torch.int64)
        return empty, empty.clone()
    # Padding has zero weight; rank it below every real key (a copy only when there is padding).
    ranked = weights if bool(valid.all()) else weights.masked_fill(~valid, -1.0)
    if first_half is None:
        first_half = torch.arange(weights.shape[1], device=weights.device) < weights.shape[1] // 2
    per_query = _top_position_totals(ranked, top)  # [H, q]
    halves = []
    for mask in (first_half, ~first_half):
        halves.append(torch.stack([per_query[:, mask].sum(dim=-1), per_query.new_full(
            (per_query.shape[0],), int(mask.sum()) * top)], dim=-1).cpu())
    return halves[0], halves[1]


def _top_position_totals(weights: torch.Tensor, top: int) -> torch.Tensor:
    """``[..., q]`` int64: the summed positions of each row's ``top`` largest weights, the ones
    ``topk`` picks.

    On the CPU, NumPy's vectorised partition finds each row's ``top``-th largest weight several
    times faster than ``topk`` selects the entries. A row without a tie at that weight holds
    exactly the positions at or above it; a row with one is handed to ``topk`` (whose pick
    among equal weights is its own), so every sum is ``topk``'s.
    """
    if weights.device.type != "cpu" or weights.dtype not in (torch.float32, torch.float64):
        return weights.topk(top, dim=-1, sorted=False).indices.sum(dim=-1)
    length = weights.shape[-1]
    kth = length - top
    threshold = torch.from_numpy(np.partition(weights.detach().numpy(), kth, axis=-1)[..., kth])
    at_or_above = (weights >= threshold[..., None]).double()
    # One float64 product gives each row's position sum and count, exactly (integers below 2^53).
    positions = torch.arange(length, dtype=torch.float64)
    sums, counts = (at_or_above @ torch.stack([positions, torch.ones_like(positions)], dim=-1)).long().unbind(dim=-1)
    tied = counts != top
    if bool(tied.any()):
        sums[tied] = weights[tied].topk(top, dim=-1, sorted=False).indices.sum(dim=-1)
    return sums


@dataclass
class ReconstructionStats:
    """Attention of the reconstruction queries to a layer's ``length`` context columns, folded
    in block by block; each block's weights cover the context chunk its queries repeat.

    total, maximum: ``[B, H, N]`` float32 sum and maximum over the queries that read each
    column; reads: ``[N]`` how many did. last: ``[B, H, N]`` the newest query's row (zero outside
    the chunk it read). count: queries seen. shift: per row, the ``(early, late)`` position sums of
    ReST-KV's drift statistic (first and second half of all ``expected`` queries; gathered only
    where ``shift_top`` is positive). sample: per row, queries kept for the ResKV validation proxy
    (the ones at ``sample_at``), ``[H, n, d]``.
    """

    expected: int
    length: int
    shift_top: list[int]
    sample_at: torch.Tensor
    total: torch.Tensor | None = None
    maximum: torch.Tensor | None = None
    last: torch.Tensor | None = None
    reads: torch.Tensor | None = None
    count: int = 0
    shift: list = field(default_factory=list)
    sample: list = field(default_factory=list)

    def add(self, weights: torch.Tensor, start: int, queries: torch.Tensor) -> None:
        """Fold in a block of ``q`` queries: ``weights`` ``[B, H, q, c]`` float32 (their softmax,
        restricted to the context columns ``[start, start + c)``), ``queries`` ``[B, H, q, d]``."""
        batch, heads, rows, width = weights.shape
        stop = start + width
        if self.total is None:
            self.total = weights.new_zeros(batch, heads, self.length)
            self.maximum, self.last = torch.zeros_like(self.total), torch.zeros_like(self.total)
            self.reads = torch.zeros(self.length, device=weights.device)
            self.shift = [None] * batch
            self.sample = [[] for _ in range(batch)]
        self.total[..., start:stop] += weights.sum(dim=2)
        torch.maximum(self.maximum[..., start:stop], weights.amax(dim=2), out=self.maximum[..., start:stop])
        self.reads[start:stop] += rows
        self.last.zero_()[..., start:stop] = weights[:, :, -1, :]
        block = torch.arange(self.count, self.count + rows, device=weights.device)
        first_half = block < self.expected // 2
        keep = torch.isin(block, self.sample_at.to(block.device))
        every = torch.ones(width, dtype=torch.bool, device=weights.device)
        for row in range(batch):
            top = min(self.shift_top[row], width)
            if top > 0:
                early, late = top_position_sums(weights[row], every, top, first_half)
                for half in (early, late):  # chunk columns -> context columns
                    half[:, 0] += start * half[:, 1]
                previous = self.shift[row]
                self.shift[row] = (early, late) if previous is None else (previous[0] + early, previous[1] + late)
            if bool(keep.any()):
                self.sample[row].append(queries[row][:, keep])
        self.count += rows


class ReconstructionObservation:
    """The reductions of a layer's ``ReconstructionStats`` (see the module docstring).

    A scorer's aggregation over its queries (``total``, ``mean``, ``aggregate``) reads them
    through ``reduce``: ``max``, the largest attention any reconstruction query gives a token
    (each query repeats one part of the context, so a token matters if some part needs it;
    their sum would favour tokens that every query attends to a little), or ``mean``.
    """

    def __init__(self, stats: ReconstructionStats, reduce: str = "max") -> None:
        if stats.total is None:
            raise ValueError("the reconstruction pass saw no query; nothing observes the context")
        self.stats = stats
        self.reduce = reduce

    def attention(self, num_queries: int | None = None) -> torch.Tensor:
        raise ValueError(
            "this scorer reads every observation query's own attention row, which --observation reconstruction "
            "does not keep (it accumulates reductions chunk by chunk)"
        )

    def total(self) -> torch.Tensor:
        return self.stats.maximum if self.reduce == "max" else self.stats.total

    def mean(self) -> torch.Tensor:
        return self.stats.maximum if self.reduce == "max" else self.stats.total / self.stats.reads.clamp(min=1)

    def maximum(self) -> torch.Tensor:
        return self.stats.maximum

    def aggregate(self, mode: str, alpha: float) -> torch.Tensor:
        """``mean`` (or ``max``) whatever ``mode``: reconstruction queries have no recency order
        relative to a question."""
        return self.mean()

    def last(self) -> torch.Tensor:
        return self.stats.last

    def shift_positions(self, row: int, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        if top != self.stats.shift_top[row]:
            raise ValueError(f"the drift statistic was accumulated for {self.stats.shift_top[row]} positions, not {top}")
        return self.stats.shift[row]

    def queries(self, row: int, count: int) -> torch.Tensor:
        sample = torch.cat(self.stats.sample[row], dim=1)
        return sample[:, sample.shape[1] - count :]

    @property
    def query_count(self) -> int:
        return sum(part.shape[1] for part in self.stats.sample[0])

    @property
    def sees_everything(self) -> bool:
        """True: a reconstruction query comes after the whole context and sees all of it."""
        return True
