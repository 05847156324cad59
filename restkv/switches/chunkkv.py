"""ChunkKV (Liu et al., 2025, arXiv 2502.00299), the ``--chunkkv`` switch: keep whole chunks, not scattered tokens.

A token means little without its neighbours; ChunkKV keeps the prompt by chunks of
``--chunkkv_length`` consecutive tokens (the row's first token opens the first, the last may be
shorter). A chunk's score is the mean over its tokens of the scorer's scores summed over the KV
heads, one ranking for every head; the protected tokens (the window) stay, and the best chunks
are added whole, in score order, while the budget holds them (the first that does not fit ends
the selection), so every head keeps the same positions and may keep fewer than the budget. A
chunk longer than a fixed budget holds beside the window is refused; where only a row's budget
(a ratio's, a layer schedule's) holds no chunk whole, the best chunk gives its best tokens. Under
chunked prefill or decode budgets the chunks stay the prompt's positions: a layer compressed again
ranks the pieces of them it holds.
It wraps any scorer with a budget shared alike by the heads (uniform or per-layer allocations);
a head-adaptive or model-wide allocation is refused.

Where this differs from kvpress' ``ChunkKVPress``: kvpress keeps ``int(n_chunks x (1 - r))``
chunks whatever their size, the window's among them (its scorer ranks the window first); at a
small budget that drops part of the window (20-token chunks at ratio 0.8 on a 384-token prompt:
it keeps 3 of the 4 window chunks, 44 tokens), and at least one chunk whole, past the
budget. Here the window always stays and the count follows the budget in tokens.

``--chunkkv_entropy_gate`` is kvpress' EntropyGatedChunkKVPress: a chunk that matters because of
one or two tokens spends its whole length on them. Each chunk's normalised entropy of its
tokens' head-summed scores (shifted to be non-negative when some are negative) tells how spread
its importance is; the chunks are taken in score order, and one that scores at least the
median chunk but whose entropy is below the median keeps only its best
``--chunkkv_spiky_tokens`` tokens; a chunk the budget no longer holds whole gives its best tokens,
and what the gate leaves unspent goes to the best remaining tokens: every head keeps exactly the
budget. Protected tokens stay and score above every other in the chunk statistics (as kvpress'
scorers score the window); kvpress' defaults are ``--chunkkv_length 10 --chunkkv_spiky_tokens 4``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from restkv.config.options import ConfigError, Options, option, register
from restkv.policies.base import require_ranking


@register("switch")
@dataclass(frozen=True)
class ChunkSelection(Options):
    """ChunkKV: keep whole chunks of consecutive tokens, ranked by their mean head-summed score."""

    name = "chunkkv"
    reference = "ChunkKV: Liu et al., 2025, arXiv 2502.00299"
    switch_help = "ChunkKV: keep whole chunks of --chunkkv_length consecutive tokens, the same for every head"

    chunkkv_length: int = option(20, "--chunkkv: tokens per chunk (at most what a fixed budget holds beside the "
                                     "window)", minimum=1)
    chunkkv_entropy_gate: bool = option(
        False, "--chunkkv: keep only the best --chunkkv_spiky_tokens of a high-scoring chunk whose score entropy is "
        "below the median (kvpress' EntropyGatedChunkKVPress), spending the rest of the budget on more chunks")
    chunkkv_spiky_tokens: int = option(4, "--chunkkv_entropy_gate: tokens kept of a spiky chunk", minimum=1)

    def validate(self) -> None:
        if self.chunkkv_entropy_gate and self.chunkkv_spiky_tokens >= self.chunkkv_length:
            raise ConfigError(f"--chunkkv_spiky_tokens {self.chunkkv_spiky_tokens} must be below --chunkkv_length "
                              f"{self.chunkkv_length} (a spiky chunk keeps fewer tokens than a whole one)")

    def check(self, config) -> None:
        require_ranking("--chunkkv", config.policy)
        if config.allocator.head_adaptive:
            raise ConfigError(f"--chunkkv keeps the same chunks in every head; --allocation {config.run.allocation} "
                              "gives the heads different budgets")
        if not self.chunkkv_entropy_gate:  # the gate takes a chunk's best tokens where it cannot take it whole
            self.check_chunks_fit(config)

    def check_chunks_fit(self, config) -> None:
        """Refuse a chunk longer than a fixed budget holds beside the protected tokens: no whole chunk fits."""
        window = config.run.window_size
        for flag in ("max_capacity_prompts", "decode_budget"):
            budget = getattr(config.run, flag)
            if budget is None:
                continue
            protected = config.policy.protected_count(window, budget)
            if self.chunkkv_length > budget - protected:
                room = (f"the {budget - protected} tokens --{flag} {budget} leaves beside the protected --window_size "
                        f"{window}" if protected else f"--{flag} {budget}")
                raise ConfigError(f"--chunkkv_length {self.chunkkv_length} must not exceed {room} (no whole chunk "
                                  "would fit)")

    def rescore(self, config, ctx, scores: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores that rank the chosen tokens first, and each head's count: the protected tokens and
        the chosen chunks (or, with the entropy gate, exactly the budget)."""
        length = scores.shape[-1]
        ranked, counts = scores.float().clone(), keep.clone()
        # Row-local positions (the same in every head): a layer compressed again holds tokens of several chunks.
        every = torch.arange(length, device=scores.device).expand(*scores.shape[:2], -1)
        local = ctx.positions_of(every)[:, 0].long() - ctx.row_padding.to(scores.device)[:, None]
        for row, visible in enumerate(ctx.plan.visible_counts.tolist()):
            columns = slice(length - visible, length)
            token_chunk = torch.unique(local[row, columns] // self.chunkkv_length, return_inverse=True)[1]
            summed = scores[row, :, columns].float().sum(dim=0)
            protected = ctx.protected[row, columns]
            choose = self.gated_tokens if self.chunkkv_entropy_gate else self.whole_chunks
            chosen = choose(summed, protected, token_chunk, int(keep[row].min()))
            spread = float(summed.max() - summed.min()) + 1 if visible else 1.0
            ranked[row, :, columns] = self.token_values(summed, token_chunk) + spread * chosen.float()
            counts[row] = int((chosen | protected).sum())
        return ranked, counts

    def token_values(self, summed: torch.Tensor, token_chunk: torch.Tensor) -> torch.Tensor:
        """Each token's value below the chosen ones: its chunk's mean score (ChunkKV), or its own (gated)."""
        return summed if self.chunkkv_entropy_gate else chunk_means(summed, token_chunk)[token_chunk]

    @staticmethod
    def whole_chunks(summed, protected, token_chunk, budget: int) -> torch.Tensor:
        """``[n]`` bool: the best chunks' unprotected tokens, whole, while the budget holds them; a
        budget that holds no chunk whole takes the best chunk's best tokens."""
        chunk_scores = chunk_means(summed, token_chunk)
        free = torch.bincount(token_chunk, weights=(~protected).float(), minlength=chunk_scores.shape[0]).long()
        held, chosen = int(protected.sum()), torch.zeros_like(protected)
        for chunk in torch.sort(chunk_scores, descending=True, stable=True).indices.tolist():
            if free[chunk] == 0:
                continue
            members = (token_chunk == chunk) & ~protected
            if held + int(free[chunk]) > budget:
                if not chosen.any():
                    best = members.nonzero().squeeze(-1)
                    chosen[best[torch.sort(summed[best], descending=True, stable=True).indices[: budget - held]]] = True
                break
            chosen |= members
            held += int(free[chunk])
        return chosen

    def gated_tokens(self, summed, protected, token_chunk, budget: int) -> torch.Tensor:
        """``[n]`` bool: the entropy gate's choice among the unprotected tokens (``budget`` in all)."""
        if bool((~protected).any()):  # protected tokens score above every other, as kvpress' scorers give them
            summed = torch.where(protected, summed[~protected].max() + 1, summed)
        chunk_count = int(token_chunk[-1]) + 1
        chunk_scores = chunk_means(summed, token_chunk)
        entropy = torch.stack([normalised_entropy(summed[token_chunk == chunk]) for chunk in range(chunk_count)])
        spiky = (chunk_scores >= chunk_scores.median()) & (entropy < entropy.median())
        left, chosen = budget - int(protected.sum()), torch.zeros_like(protected)
        for chunk in torch.sort(chunk_scores, descending=True, stable=True).indices.tolist():
            if left <= 0:
                break
            members = ((token_chunk == chunk) & ~protected).nonzero().squeeze(-1)
            take = min(members.numel(), left)
            if spiky[chunk]:
                take = min(take, max(self.chunkkv_spiky_tokens - int(protected[token_chunk == chunk].sum()), 0))
            chosen[members[torch.sort(summed[members], descending=True, stable=True).indices[:take]]] = True
            left -= take
        rest = (~chosen & ~protected).nonzero().squeeze(-1)
        if left > 0 and rest.numel():
            chosen[rest[torch.sort(summed[rest], descending=True, stable=True).indices[:left]]] = True
        return chosen


def chunk_means(summed: torch.Tensor, token_chunk: torch.Tensor) -> torch.Tensor:
    """``[n_chunks]`` each chunk's mean token score."""
    count = int(token_chunk[-1]) + 1 if token_chunk.numel() else 0
    totals = torch.zeros(count, device=summed.device).index_add_(0, token_chunk, summed)
    return totals / torch.bincount(token_chunk, minlength=count)


def normalised_entropy(values: torch.Tensor, epsilon: float = 1e-8) -> torch.Tensor:
    """The entropy of ``values`` (shifted to be non-negative if some are negative) as a distribution,
    divided by its maximum ``log n``, in [0, 1]; 0 for a single value."""
    if values.numel() < 2:
        return torch.zeros((), device=values.device)
    shifted = values - values.min().clamp(max=0.0)
    share = shifted / (shifted.sum() + epsilon)
    return (-(share * (share + epsilon).log()).sum() / math.log(values.numel())).clamp(0.0, 1.0)
