"""Independent chunks (kvpress' ChunkPress), the ``--chunk_press`` switch: each chunk of the prompt compressed alone.

The prompt is cut into chunks of ``--chunk_press_length`` tokens (the row's first token opens the first, the last
may be shorter); each chunk is scored by the method as if it were the whole prompt (its own
keys, values and queries: a window scorer reads the chunk's last ``--window_size`` queries, a
sink-keeping one keeps the chunk's first tokens) and keeps its share of the row's budget, as
kvpress gives it: ``max(1, int(n_chunk (1 - r)))`` tokens per KV head at the row's ratio ``r``
(``--compression_ratio``; under a token budget ``B`` of ``L`` tokens, ``1 - B / L``), so every part of a
long prompt keeps the same density and no chunk's scores compete with another's. The shares
never exceed the budget: where kvpress' one token per chunk would (chunks shorter than ``1 / (1 -
r)`` tokens), the budget is split by the chunks' ends, ``floor(end B / L) - floor(start B / L)``
per chunk. A chunk whose share does not exceed what the method protects in it (a short last
chunk and the window) keeps its newest tokens. Scoring is per chunk, so the cost
of an attention scorer falls from the prompt's length to the chunk's.

It needs the prompt's own queries at its prefill: a deferring setting (reconstruction, a
model-wide allocation), chunked prefill and decode budgets are refused in one line, as are
head-adaptive allocations (each chunk's share is the same in every head). With
``--chunk_press_global`` the chunks are not scored alone: each keeps its share by the method's
scores of the whole prompt (FinchPress' ``chunk_length``), which composes with deferring
settings too.

Where this differs from kvpress' ``ChunkPress``: kvpress hands the inner press the RoPE tables
of the whole prompt, so a SnapKV chunk's recomputed window queries sit at the prompt's last
positions; here the queries keep their own positions.
Where kvpress' shares of short chunks sum to more than the budget, it keeps them all.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from restkv.config import kept_at_ratio
from restkv.config.options import ConfigError, Options, option, register
from restkv.pipeline.inputs import LayerInputs
from restkv.pipeline.plan import plan_layer
from restkv.policies.base import require_ranking
from restkv.scoring.rope import rotate, unrotate
from restkv.scoring.selection import descending_ranks, rank_keys, select_columns


@register("switch")
@dataclass(frozen=True)
class IndependentChunks(Options):
    """ChunkPress: each chunk of the prompt scored alone, keeping its share of the budget."""

    name = "chunk_press"
    reference = "kvpress' ChunkPress (NVIDIA kvpress)"
    switch_help = ("kvpress' ChunkPress: score each --chunk_press_length-token chunk of the prompt alone, each "
                   "keeping its share of the budget")

    chunk_press_length: int = option(1024, "--chunk_press: tokens per chunk scored alone", minimum=1)
    chunk_press_global: bool = option(
        False, "--chunk_press: choose each chunk's share by the method's scores of the whole prompt (Finch's "
        "chunk_length) instead of scoring each chunk alone")
    chunk_press_kvpress_rope: bool = option(
        False, "--chunk_press: turn each chunk's window queries to the prompt's last positions, as kvpress 0.5.5 "
        "does by handing the inner press the whole prompt's RoPE tables (for parity)")

    def check(self, config) -> None:
        check_pieces_scored_at_prefill(config, "--chunk_press", "each chunk", "gives each chunk the same share in "
                                       "every head", deferring=not self.chunk_press_global)

    def pre_rope_flags(self) -> list[str]:
        return ["--chunk_press_kvpress_rope"] if self.chunk_press_kvpress_rope else []

    def rescore(self, config, ctx, scores: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores that rank each chunk's own choice first, and each head's count: the chunks' shares."""
        length = scores.shape[-1]
        ranked = torch.zeros_like(scores, dtype=torch.float32)
        counts = keep.clone()
        for row, visible in enumerate(ctx.plan.visible_counts.tolist()):
            starts = range(length - visible, length, self.chunk_press_length)
            sizes = [min(self.chunk_press_length, length - start) for start in starts]
            shares = chunk_shares(config, sizes, int(ctx.budgets[row]))
            for start, size, share in zip(starts, sizes, shares):
                columns = slice(start, start + size)
                chosen = (self.global_choice(ctx, scores, row, columns, share) if self.chunk_press_global
                          else self.chunk_choice(config, ctx, row, columns, share))
                ranked[row, :, columns] = chosen.float()
            counts[row] = sum(shares)
        return ranked, counts

    @staticmethod
    def global_choice(ctx: LayerInputs, scores: torch.Tensor, row: int, columns: slice, share: int) -> torch.Tensor:
        """``[H_kv, n]`` bool: the chunk's protected tokens and its best-scored others (by the whole
        prompt's ``scores``), ``share`` per head in all."""
        protected = ctx.protected[row, columns]
        ranked = scores[row, :, columns].float().masked_fill(~ctx.candidates[row, columns], float("-inf"))
        return protected[None] | (descending_ranks(ranked) < share - int(protected.sum()))

    def chunk_choice(self, config, ctx: LayerInputs, row: int, columns: slice, share: int) -> torch.Tensor:
        """``[H_kv, n]`` bool: the ``share`` tokens per head the method keeps of row ``row``'s
        chunk at ``columns``, scored as a prompt of its own."""
        piece = lambda t: t[row : row + 1, :, columns]  # noqa: E731
        rotary = None if ctx.rotary is None else tuple(table[row : row + 1, columns] for table in ctx.rotary)
        query = piece(ctx.query)
        if self.chunk_press_kvpress_rope:
            query = self.kvpress_window_queries(ctx, row, query, rotary, config.run.window_size)
        hidden = None if ctx.hidden is None else ctx.hidden[row : row + 1, columns]
        return choose_as_prompt(config, ctx, query, piece(ctx.key), piece(ctx.value), share, rotary, hidden)

    @staticmethod
    def kvpress_window_queries(ctx: LayerInputs, row: int, query: torch.Tensor, rotary, window: int) -> torch.Tensor:
        """``query`` ``[1, H, n, d]`` with its last ``window`` queries turned to the prompt's last
        ``window`` positions (kvpress' ChunkPress with a scorer that recomputes them)."""
        if ctx.rotary is None:
            raise ValueError("--chunk_press_kvpress_rope turns queries to other positions: give compress_kv rotary=")
        window = min(window, query.shape[2])
        if window == 0:
            return query
        cos, sin = (table[:, -window:] for table in rotary)
        last_cos, last_sin = (table[row : row + 1, -window:] for table in ctx.rotary)
        turned = rotate(unrotate(query[:, :, -window:], cos, sin), last_cos, last_sin)
        return torch.cat([query[:, :, :-window], turned], dim=2)


def chunk_shares(config, sizes: list[int], budget: int) -> list[int]:
    """Each chunk's share of a row's ``budget`` (chunks of ``sizes`` tokens, in order): kvpress'
    ``max(1, int(n (1 - r)))`` at the row's ratio ``r`` (the run's ``--compression_ratio`` when the row
    keeps its budget, else ``1 - budget / L``). Where those exceed the budget (chunks shorter than
    ``1 / (1 - r)`` tokens, one token each), the budget is split by the chunks' ends instead:
    ``floor(end x budget / L) - floor(start x budget / L)``, exactly the budget in all."""
    length, ratio = sum(sizes), config.run.compression_ratio
    if ratio is not None and kept_at_ratio(length, ratio) == budget:
        shares = [max(1, kept_at_ratio(size, ratio)) for size in sizes]
    else:
        shares = [max(1, size * budget // length) for size in sizes]
    if sum(shares) <= budget:
        return shares
    marks = [end * budget // length for end in itertools.accumulate(sizes, initial=0)]
    return [stop - start for start, stop in zip(marks, marks[1:])]


def check_pieces_scored_at_prefill(config, flag: str, pieces: str, uniform: str, deferring: bool = True) -> None:
    """Refuse (one line naming ``flag``) what a part that scores ``pieces`` of the prompt as prompts
    of their own cannot have: settings that deny it the prompt's queries at its prefill (chunked
    prefill, decode budgets, and unless ``deferring`` is False reconstruction and model-wide
    allocations), head-adaptive budgets (the part ``uniform``), a method with no ranking."""
    flags = config.rescoring_flags() + (config.deferring_flags() if deferring else [])
    if flags:
        raise ConfigError(f"{flag} scores {pieces} with the prompt's own queries at its prefill; "
                          f"{' and '.join(flags)} cannot give them")
    if config.allocator.head_adaptive:
        raise ConfigError(f"{flag} {uniform}; --allocation {config.run.allocation} gives the heads different budgets")
    require_ranking(flag, config.policy)


def choose_as_prompt(config, ctx: LayerInputs, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     share: int, rotary=None, hidden=None) -> torch.Tensor:
    """``[H_kv, n]`` bool: the ``share`` tokens per KV head the method keeps of a piece of layer
    ``ctx``'s prompt (``query`` ``[1, H, n, d]``, ``key``/``value`` ``[1, H_kv, n, d]``, in position
    order) scored as a prompt of its own: its last ``--window_size`` queries observe, its first
    tokens are its sinks. A piece whose share does not exceed what the method protects in it
    keeps its newest tokens."""
    count, policy, window = key.shape[2], config.policy, config.run.window_size
    if share < count and (share <= policy.protected_count(window, share) or not policy.compressible_to(window, share)):
        newest = torch.zeros(key.shape[1], count, dtype=torch.bool, device=key.device)
        newest[:, count - share :] = True
        return newest
    valid = torch.ones(1, count, dtype=torch.bool, device=key.device)
    plan = plan_layer(config, valid, ctx.layer_idx, ctx.num_layers, budgets=[share])
    piece = LayerInputs(query, key, value, plan, ctx.facts, rotary=rotary, hidden=hidden)
    if not plan.compress:
        return torch.ones(key.shape[1:3], dtype=torch.bool, device=key.device)
    selected = select_columns(rank_keys(policy.score(piece), plan.visible, plan.protected, ctx.layer_idx),
                              torch.full((1, piece.num_kv_heads), share, device=key.device))
    chosen = torch.zeros(key.shape[:3], dtype=torch.bool, device=key.device)
    return chosen.scatter_(2, selected.clamp(min=0).long(), selected >= 0)[0]
