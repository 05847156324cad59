"""One layer's prefill plan, and the context every scorer sees.

``plan_layer`` decides once per layer what the compressing prefill does: which tokens are
real, which ones the next query can still see (a sliding-window layer forgets older
ones), each row's budget, the protected tokens, and whether anything is evicted at all.
The attention forward, ``compress_kv`` and the benchmark runners' "did every layer
compress" check all read the same plan.

Positions: every tensor here indexes the padded batch (prompts are left-padded; column
``j`` of row ``b`` is real iff ``valid[b, j]``). Only the notebook-facing return of
``restkv.compress_kv`` converts them to row-local positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from restkv.config.options import ConfigError
from restkv.scoring.observation import WindowObservation
from restkv.scoring.rope import unrotate
from restkv.scoring.window import pool_scores, reduce_groups


@dataclass(frozen=True)
class LayerPlan:
    """What one layer's compressing prefill does (see the module docstring).

    valid: ``[B, N]`` bool, real tokens.
    visible: ``[B, N]`` bool, real tokens the next query can still attend to (all of them, or
        on a sliding-window layer the last ``sliding_window - 1``): the tokens that compete.
    budgets: ``[B]`` tokens each row keeps per KV head (window included, at most its visible tokens).
    protected: ``[B, N]`` bool, tokens kept whatever their score (the recent window).
    compress: whether any row holds more visible tokens than its budget (else the layer is
        stored as it is).
    shared_heads: every KV head keeps the same tokens (their scores averaged, the smallest head's
        count), for a module that reads each head's values from other heads (DiffLlama).
    """

    valid: torch.Tensor
    visible: torch.Tensor
    budgets: torch.Tensor
    protected: torch.Tensor
    compress: bool
    layer_idx: int
    num_layers: int
    window_size: int
    seed: int
    sliding_window: int | None = None
    shared_heads: bool = False

    @property
    def lengths(self) -> torch.Tensor:
        """``[B]`` real tokens per row."""
        return self.valid.sum(dim=-1)

    @property
    def visible_counts(self) -> torch.Tensor:
        """``[B]`` visible tokens per row."""
        return self.visible.sum(dim=-1)

    @property
    def candidates(self) -> torch.Tensor:
        """``[B, N]`` bool, tokens that compete for the budget (visible and not protected)."""
        return self.visible & ~self.protected

    @property
    def padding(self) -> torch.Tensor:
        """``[B]`` left-padding columns of each row (padded column = row-local position + padding)."""
        return self.valid.shape[-1] - self.lengths


def plan_layer(config: Any, valid: torch.Tensor, layer_idx: int = 0, num_layers: int = 1,
               sliding_window: int | None = None, budgets: list[int] | None = None,
               context_span: tuple[int, int] | None = None, seen: list[int] | None = None) -> LayerPlan:
    """The prefill plan of layer ``layer_idx`` for a left-padded prompt with real tokens ``valid``.

    ``config`` is a ``restkv.config.CompressionConfig``; ``budgets`` overrides its budget of
    each row (a layer compressed again keeps the budget of all the tokens it has seen);
    ``context_span``: the row-local ``(start, stop)`` of the context, every token outside it
    protected too (``restkv.integrations.transformers.context_span``); ``seen``: the tokens each row has seen, where the layer
    holds fewer (a recompression; default: its visible tokens), which a layer's own budget counts
    (``layer_budgets``). Raises ``ConfigError`` when a row that must be compressed cannot keep more
    than its protected tokens (a ratio budget on a short row).
    """
    if not 0 <= layer_idx < num_layers:
        raise ValueError(f"layer_idx {layer_idx} must lie in 0..{num_layers - 1} (num_layers {num_layers})")
    policy = config.policy
    visible = valid
    length = valid.shape[-1]
    if sliding_window is not None:
        visible = valid & (torch.arange(length, device=valid.device) >= length - sliding_window + 1)
    # One host transfer for every row's sizes.
    lengths, counts = valid.sum(dim=-1).tolist(), visible.sum(dim=-1).tolist()
    wanted = budgets if budgets is not None else [config.budget_for(int(n)) for n in lengths]
    budgets = [min(int(b), int(c)) for b, c in zip(wanted, counts)]
    window = config.run.window_size
    protected_counts = [policy.protected_count(window, budget) for budget in budgets]
    layered = layer_budgets(config, budgets, seen or counts, layer_idx, num_layers)
    compress = policy.evicts and policy.compresses_layer(layer_idx) and any(
        budget < count for budget, count in zip(layered, counts)
    )
    if compress:
        for count, budget, protected in zip(counts, budgets, protected_counts):
            if count > budget:
                policy.check_row(config, count, budget, protected)
    budgets = layered
    start = torch.tensor([length - c for c in protected_counts], device=valid.device)
    protected = (torch.arange(length, device=valid.device)[None, :] >= start[:, None]) & visible
    if context_span is not None:
        protected = protected | _around(valid, visible, context_span)
        if compress:
            for count, budget, around in zip(counts, budgets, protected.sum(dim=-1).tolist()):
                if count > budget and around >= budget:
                    raise ConfigError(
                        f"the {around} protected tokens (the template around context_span {tuple(context_span)} "
                        f"and the window) fill the budget of {budget}: raise the budget")
    return LayerPlan(valid, visible, torch.tensor(budgets, device=valid.device), protected, compress,
                     layer_idx, num_layers, window, config.run.seed, sliding_window)


def layer_budgets(config: Any, budgets: list[int], seen: list[int], layer_idx: int, num_layers: int) -> list[int]:
    """Each row's budget on layer ``layer_idx``: the allocation's for the layer (``Allocation.layer_budget``:
    ``--allocation per_layer``'s ratio of the ``seen`` tokens) within the run's ``budgets``, never below
    the row's protected tokens (they stay whatever the ratio)."""
    window = config.run.window_size
    return [min(budget, max(config.allocator.layer_budget(budget, int(count), layer_idx, num_layers),
                            config.policy.protected_count(window, budget)))
            for budget, count in zip(budgets, seen)]


def _around(valid: torch.Tensor, visible: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    """``[B, N]`` bool: the visible tokens outside each row's context ``span`` (row-local)."""
    length = valid.shape[-1]
    local = torch.arange(length, device=valid.device)[None, :] - (length - valid.sum(dim=-1))[:, None]
    return visible & ((local < span[0]) | (local >= span[1]))


def valid_from_mask(attention_mask: torch.Tensor | None, batch: int, length: int, device,
                    empty_rows: bool = False) -> torch.Tensor:
    """``[B, N]`` bool real-token mask from an optional 2-D 0/1 mask; checks left padding (and
    that every row holds a real token, unless ``empty_rows``)."""
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    if attention_mask.shape != (batch, length):
        raise ValueError(f"attention_mask must have shape [B, N] = [{batch}, {length}], got {list(attention_mask.shape)}")
    valid = attention_mask.to(device=device).bool()
    # Left padding: once a row has a real token, every later column is real.
    if bool((valid[:, :-1] & ~valid[:, 1:]).any()):
        raise ValueError(
            "restkv expects left padding (tokenizer.padding_side = 'left'); the attention mask has padding "
            "after a real token"
        )
    if not empty_rows and not bool(valid.any(dim=-1).all()):
        raise ValueError("a row of the batch is all padding; every row needs at least one real token")
    return valid


@dataclass
class ScoringContext:
    """One layer's prompt, as every scorer sees it.

    query: ``[B, H, n, d]`` post-RoPE queries of the last ``n`` prompt tokens (all of them, or
        those the observation window and the residual cache read).
    key, value: ``[B, H_kv, N, d]``, stored once per KV head.
    plan: the layer's ``LayerPlan`` (real and visible tokens, budgets, protected tokens).
    scaling, softcap: the layer's attention scale and logit soft-cap.
    o_proj_weight: ``[D, H*d]`` output projection (methods that score in output space).
    observation: what the scorers read of the observation queries (``restkv.scoring.observation``;
        default: the window of the last ``window_size`` prompt queries). Its reductions are
        computed once and shared by every part of the layer's compression.
    positions: ``[B, H_kv, N]`` the padded-batch column of every key, when the keys are not the
        prompt itself (recompression scores each head's held tokens as its own sequence); None:
        key ``j`` is column ``j``. prompt_padding: ``[B]`` each row's left padding in those columns
        (with ``positions``).
    rotary: the ``(cos, sin)`` ``[B, N, d]`` the keys were rotated with (the forward's position
        embeddings), for parts that read keys before RoPE (``pre_rope_key``); None where unknown.
    hidden: ``[B, N, D]`` the attention's input (after the layer's input norm) at every key, for
        scorers of hidden states (``Policy.needs_hidden_states``: KVzap); None where not kept.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    plan: LayerPlan
    scaling: float
    softcap: float | None = None
    o_proj_weight: torch.Tensor | None = None
    observation: Any = field(default=None, repr=False)
    positions: torch.Tensor | None = field(default=None, repr=False)
    prompt_padding: torch.Tensor | None = field(default=None, repr=False)
    rotary: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    hidden: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.observation is None:
            self.observation = WindowObservation(self)
        if self.rotary is not None:  # a model called without position_ids gives every row one [1, N, d] table
            self.rotary = tuple(table.expand(self.key.shape[0], -1, -1) for table in self.rotary)

    @classmethod
    def of(cls, query, key, value, plan: LayerPlan, scaling: float | None = None, softcap=None,
           o_proj_weight=None, observation=None, positions=None, prompt_padding=None,
           rotary=None, hidden=None) -> "ScoringContext":
        return cls(query, key, value, plan, scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1]),
                   softcap, o_proj_weight, observation, positions, prompt_padding, rotary, hidden)

    @property
    def pre_rope_key(self) -> torch.Tensor | None:
        """``[B, H_kv, N, d]`` the keys before RoPE (None without ``rotary``)."""
        return None if self.rotary is None else unrotate(self.key, *self.rotary)

    @property
    def row_padding(self) -> torch.Tensor:
        """``[B]`` each row's left padding in the padded batch the ``positions`` index (the plan's,
        unless the keys are held sequences: ``prompt_padding`` then)."""
        return self.plan.padding if self.prompt_padding is None else self.prompt_padding

    def positions_of(self, columns: torch.Tensor) -> torch.Tensor:
        """``[B, H_kv, K]`` int32 padded-batch columns of the keys at ``columns`` (-1 stays -1)."""
        if self.positions is None:
            return columns.to(torch.int32)
        picked = self.positions.gather(2, columns.clamp(min=0).long())
        return torch.where(columns >= 0, picked, -1).to(torch.int32)

    # The plan's fields, as scorers read them.
    @property
    def valid(self) -> torch.Tensor:
        return self.plan.valid

    @property
    def visible(self) -> torch.Tensor:
        return self.plan.visible

    @property
    def budgets(self) -> torch.Tensor:
        return self.plan.budgets

    @property
    def protected(self) -> torch.Tensor:
        return self.plan.protected

    @property
    def candidates(self) -> torch.Tensor:
        return self.plan.candidates

    @property
    def layer_idx(self) -> int:
        return self.plan.layer_idx

    @property
    def num_layers(self) -> int:
        return self.plan.num_layers

    @property
    def window_size(self) -> int:
        return self.plan.window_size

    @property
    def num_kv_heads(self) -> int:
        return self.key.shape[1]

    def window_attention(self, num_queries: int | None = None) -> torch.Tensor:
        """``[B, H, w, N]`` attention of the observation window's queries (``WindowObservation.attention``)."""
        return self.observation.attention(num_queries)

    def reduce_groups(self, scores: torch.Tensor, how: str = "mean") -> torch.Tensor:
        """Per-query-head ``[B, H, N]`` to per-KV-head ``[B, H_kv, N]``."""
        return reduce_groups(scores, self.num_kv_heads, how)

    def pool(self, scores: torch.Tensor, pooling: str, kernel_size: int) -> torch.Tensor:
        """Plain spatial smoothing (``none``, ``avgpool``, ``maxpool``) over the candidates."""
        return pool_scores(scores, self.plan.candidates, pooling, kernel_size)


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
