"""Block-wise scoring (kvpress' BlockPress, after Keyformer/"SnapKV in blocks"), the ``--block_press`` switch.

A long prompt scored at once lets every token compete with every other under one set of
observation queries. Block-wise scoring walks the prompt instead, as a streaming cache would:
each KV head starts from the row's first ``B`` tokens (``B`` its budget); each following block
of ``--block_press_size`` tokens joins them, and the method scores the ``B + block`` tokens as a
prompt of its own (the block's last ``--window_size`` queries observe, the held tokens' first
ones are its sinks) and keeps its best ``B``, which the next block meets. The last block's choice
is what the layer keeps. Peak scoring work is that of ``B + block`` tokens, whatever the prompt's
length.

Each head holds its own tokens, so each query head reads its KV head's. It needs the prompt's
own queries at its prefill: deferring settings (reconstruction, model-wide allocations), chunked
prefill and decode budgets are refused, as are head-adaptive allocations (each head keeps its
budget at every block) and scorers that read RoPE tables per position (a head's held tokens are
not consecutive).

Where this differs from kvpress' ``BlockPress``: kvpress keeps the held tokens in top-k order,
and a scorer that pools along the sequence (SnapKV) then pools along that order; it splits the
hidden state into per-head slices gathered with each head's own indices (a recomputed query can
mix tokens), and hands the inner press the whole prompt's RoPE tables (the window queries turned
to the prompt's last positions). Here the held tokens stay
in position order and every query is the model's own, at its position: for an order-free scorer
(KeyDiff, Knorm) the kept sets are kvpress', for SnapKV they differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import ConfigError, Options, option, register
from restkv.switches.chunk_press import check_pieces_scored_at_prefill, choose_as_prompt


@register("switch")
@dataclass(frozen=True)
class BlockScoring(Options):
    """BlockPress: each block of the prompt scored with the tokens kept so far, keeping the budget."""

    name = "block_press"
    reference = "kvpress' BlockPress (NVIDIA kvpress)"
    switch_help = ("kvpress' BlockPress: walk the prompt in --block_press_size-token blocks, each scored with the "
                   "tokens kept so far as a prompt of its own, keeping the budget")

    block_press_size: int = option(128, "--block_press: tokens per block", minimum=1)

    def check(self, config) -> None:
        check_pieces_scored_at_prefill(config, "--block_press", "each block", "keeps each head's budget at every block")
        if config.policy.needs_rotary or config.policy.needs_hidden_states:
            raise ConfigError(f"--block_press scores each head's own held tokens, which are not consecutive; "
                              f"--method {config.run.method} reads the RoPE tables or hidden states of the prompt's "
                              "positions")

    def rescore(self, config, ctx, scores: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores that rank each head's last block choice first; the counts as allocated."""
        length, heads = scores.shape[-1], ctx.num_kv_heads
        if ctx.query.shape[2] != length:
            raise ValueError("--block_press reads every prompt query: give compress_kv the queries of all tokens")
        ranked = torch.zeros_like(scores, dtype=torch.float32)
        groups = ctx.query.shape[1] // heads
        for row, visible in enumerate(ctx.plan.visible_counts.tolist()):
            first, budget = length - visible, int(keep[row].max())
            held = torch.arange(first, first + min(budget, visible), device=scores.device).expand(heads, -1)
            for start in range(first + budget, length, self.block_press_size):
                block = torch.arange(start, min(start + self.block_press_size, length), device=scores.device)
                columns = torch.cat([held, block.expand(heads, -1)], dim=1)  # [H_kv, m], ascending
                take = lambda t, index: t[row].gather(1, index[..., None].expand(-1, -1, t.shape[-1]))[None]  # noqa: E731
                chosen = choose_as_prompt(config, ctx, take(ctx.query, columns.repeat_interleave(groups, dim=0)),
                                          take(ctx.key, columns), take(ctx.value, columns), budget)
                held = columns[chosen].view(heads, -1)
            ranked[row].scatter_(1, held, 1.0)
        return ranked, keep
