"""ChunkKV (Liu et al., 2025, arXiv 2502.00299), the ``--chunkkv`` switch: keep whole chunks, not scattered tokens.

A token means little without its neighbours; ChunkKV keeps the prompt by chunks of
``--chunkkv_length`` consecutive tokens (the row's first token opens the first, the last may be
shorter). A chunk's score is the mean over its tokens of the scorer's scores summed over the KV
heads, one ranking for every head; the protected tokens (the window) stay, and the best chunks
are added whole, in score order, while the budget holds them (the first that does not fit ends
the selection), so every head keeps the same positions and may keep fewer than the budget.
It wraps any scorer with a budget shared alike by the heads (uniform or per-layer allocations);
a head-adaptive or model-wide allocation is refused.

Where this differs from kvpress' ``ChunkKVPress``: kvpress keeps ``int(n_chunks x (1 - r))``
chunks whatever their size, the window's among them (its scorer ranks the window first); at a
small budget that drops part of the window (``../shared/golden_kvpress`` §12: at ratio 0.8 on 384
tokens it keeps 3 of the 4 window chunks, 44 tokens). Here the window always stays and the
count follows the budget in tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.options import ConfigError, Options, option, register
from restkv.policies.base import require_ranking


@register("switch")
@dataclass(frozen=True)
class ChunkSelection(Options):
    """ChunkKV: keep whole chunks of consecutive tokens, ranked by their mean head-summed score."""

    name = "chunkkv"
    switch_help = "ChunkKV: keep whole chunks of --chunkkv_length consecutive tokens, the same for every head"

    chunkkv_length: int = option(20, "--chunkkv: tokens per chunk", minimum=1)

    def check(self, config) -> None:
        require_ranking("--chunkkv", config.policy)
        if config.allocator.head_adaptive:
            raise ConfigError(f"--chunkkv keeps the same chunks in every head; --allocation {config.run.allocation} "
                              "gives the heads different budgets")

    def rescore(self, config, ctx, scores: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores that rank the chosen chunks first (each token its chunk's score), and each head's
        count: the protected tokens and the chosen chunks."""
        length = scores.shape[-1]
        ranked, counts = scores.float().clone(), keep.clone()
        for row, visible in enumerate(ctx.plan.visible_counts.tolist()):
            columns = slice(length - visible, length)
            token_chunk = torch.arange(visible, device=scores.device) // self.chunkkv_length
            chunk_count = int(token_chunk[-1]) + 1 if visible else 0
            summed = scores[row, :, columns].float().sum(dim=0)
            chunk_scores = torch.zeros(chunk_count, device=scores.device).index_add_(0, token_chunk, summed)
            chunk_scores /= torch.bincount(token_chunk, minlength=chunk_count)
            protected = ctx.protected[row, columns]
            free = torch.bincount(token_chunk, weights=(~protected).float(), minlength=chunk_count).long()
            held, chosen = int(protected.sum()), torch.zeros(chunk_count, dtype=torch.bool, device=scores.device)
            for chunk in torch.sort(chunk_scores, descending=True, stable=True).indices.tolist():
                if free[chunk] == 0:
                    continue
                if held + int(free[chunk]) > int(keep[row].min()):
                    break
                chosen[chunk], held = True, held + int(free[chunk])
            spread = float(chunk_scores.max() - chunk_scores.min()) + 1 if chunk_count else 1.0
            per_token = chunk_scores[token_chunk] + spread * chosen[token_chunk].float()
            ranked[row, :, columns] = per_token
            counts[row] = held
        return ranked, counts
