"""The one object a layer's compression reads: its inputs (``LayerInputs``) and what its attention is
(``LayerFacts``).

Built once where the attention runs (``restkv.integrations.transformers.steps``) or by ``compress_kv``, and
carried unchanged to every scorer, allocation, switch, deferred layer and recompression: a scorer that
reads something new (hidden states, the rotation, the output projection) reads it from here, and a part
that needs a piece of the prompt scored as a prompt of its own (``--chunk_press``) makes a new one with
``dataclasses.replace``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from restkv.pipeline.plan import LayerPlan, LayerShape
from restkv.scoring.observation import WindowObservation
from restkv.scoring.rope import unrotate
from restkv.scoring.window import pool_scores, reduce_groups


@dataclass(frozen=True)
class LayerFacts:
    """What one layer's attention is, as its module hands it to its kernel.

    scaling: the attention scale; softcap: its logit soft-cap (Gemma 2), or None; sliding_window: the
    window of a sliding-window layer, or None; o_proj_weight: ``[D, H * d]`` its output projection (scorers
    in output space), or None where unknown.
    """

    scaling: float
    softcap: float | None = None
    sliding_window: int | None = None
    o_proj_weight: torch.Tensor | None = field(default=None, repr=False, compare=False)


@dataclass
class LayerInputs:
    """One layer's inputs, as every part of its compression reads them: built once where the attention runs
    (or by ``compress_kv``), carried unchanged to every scorer, switch, deferred layer and recompression.

    query: ``[B, H, n, d]`` post-RoPE queries of the last ``n`` prompt tokens (all of them, or
        those the observation window and the residual cache read).
    key, value: ``[B, H_kv, N, d]``, stored once per KV head.
    plan: the layer's ``LayerPlan`` (real and visible tokens, budgets, protected tokens).
    facts: what the layer's attention is (``LayerFacts``: scale, soft-cap, output projection; default: the
        scale ``1 / sqrt(d)`` and nothing else).
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
    query_rotary: the ``(cos, sin)`` ``[B, n, d]`` the queries were rotated with, where they are not the last
        keys' (a compression during generation scores held tokens with the newest tokens' queries); None where
        unknown.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    plan: LayerPlan
    facts: LayerFacts | None = None
    observation: Any = field(default=None, repr=False)
    positions: torch.Tensor | None = field(default=None, repr=False)
    prompt_padding: torch.Tensor | None = field(default=None, repr=False)
    rotary: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    hidden: torch.Tensor | None = field(default=None, repr=False)
    query_rotary: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.facts is None:
            self.facts = LayerFacts(1.0 / math.sqrt(self.query.shape[-1]))
        if self.observation is None:
            self.observation = WindowObservation(self)
        if self.rotary is not None:  # a model called without position_ids gives every row one [1, N, d] table
            self.rotary = tuple(table.expand(self.key.shape[0], -1, -1) for table in self.rotary)

    # What the layer's attention is, as scorers read it.
    @property
    def scaling(self) -> float:
        return self.facts.scaling

    @property
    def softcap(self) -> float | None:
        return self.facts.softcap

    @property
    def o_proj_weight(self) -> torch.Tensor | None:
        return self.facts.o_proj_weight

    @property
    def shape(self) -> LayerShape:
        """Where the layer sits and how many heads it has (what allocations read besides the scores)."""
        return LayerShape(self.layer_idx, self.num_layers, self.query.shape[1], self.num_kv_heads)

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
