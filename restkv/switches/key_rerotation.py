"""Key re-rotation after eviction (kvpress' ``KeyRerotationPress``, Finch's ``rerotate_keys``), the ``--rerotate_keys`` switch.

Eviction leaves gaps between the kept tokens' positions: a question after a 10%-kept context
sees its nearest kept token at distance 1 but the oldest at the whole context's length, far
beyond what the kept tokens span. Re-rotation closes the gaps: each KV head's kept keys are
turned from their own positions to consecutive ones, so RoPE reads the kept tokens as one
contiguous text.

kvpress moves a head's ``n`` kept keys to positions ``0 .. n-1`` and starts the question at
``n`` (its pipeline reads the cache's new length). RoPE attention depends only on the distance
between query and key, so restkv moves them to the ``n`` positions that end at the prompt's last
one instead: every query then sees every kept key at the distance kvpress' compact positions
give, while later tokens keep their positions (the cache's positions contract, padded batches
and heads that keep different counts work unchanged). The turn is
``rotate(unrotate(k, cos_old, sin_old), cos_new, sin_new)`` with the forward's own RoPE tables
(any rope scaling), in float32. ``kept_positions`` still reports each token's prompt position.

Keys are turned once, at the prefill's compression (with a model-wide allocation or
reconstruction, after the whole prefill): chunked prefill and decode budgets compress stored
keys again and are refused, as are parts that keep summaries of the evicted keys (they would
stay at the old positions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import ConfigError, Options, register
from restkv.scoring.rope import rotate, unrotate


@register("switch")
@dataclass(frozen=True)
class KeyRerotation(Options):
    """kvpress' KeyRerotationPress: each head's kept keys turned to consecutive positions."""

    name = "rerotate_keys"
    reference = "kvpress' KeyRerotationPress (NVIDIA kvpress), as Finch re-rotates kept keys (arXiv 2408.00167)"
    switch_help = ("re-rotate each head's kept keys to consecutive positions ending at the prompt's last one (kvpress' "
                   "KeyRerotationPress, Finch's rerotate_keys): the gaps eviction left are closed for RoPE")

    def check(self, config) -> None:
        from restkv.pipeline.compress import summarisers

        flags = config.rescoring_flags()
        if flags:
            raise ConfigError(f"--rerotate_keys turns the kept keys once, at the prefill's compression; "
                              f"{' and '.join(flags)} would compress turned keys again")
        summarising = [config.chosen_by(part) for part in summarisers(config)]
        if summarising:
            raise ConfigError(f"--rerotate_keys turns the kept keys; the summaries of {', '.join(summarising)} are "
                              "made from evicted keys at their own positions")

    def pre_rope_flags(self) -> list[str]:
        return ["--rerotate_keys"]

    def rewrite_keys(self, ctx, columns: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """The kept ``keys`` ``[B, H_kv, K, d]`` at ``columns`` (ascending, -1 slots last) turned
        to consecutive positions ending at the prompt's last column."""
        if ctx.rotary is None:
            raise ValueError("--rerotate_keys turns keys with the RoPE tables they were rotated with: give "
                             "compress_kv the layer's rotary=(cos, sin)")
        if ctx.positions is not None:
            raise ValueError("--rerotate_keys turns keys at their prefill; these keys are held sequences")
        held = (columns >= 0).sum(dim=-1, keepdim=True)  # [B, H_kv, 1]
        slots = torch.arange(columns.shape[-1], device=columns.device)
        targets = (ctx.key.shape[2] - held + slots).clamp(max=ctx.key.shape[2] - 1)
        batch, heads, width, dim = keys.shape

        def tables_at(where: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            index = where.clamp(min=0).reshape(batch, heads * width, 1).expand(-1, -1, dim)
            return tuple(table.expand(batch, -1, -1).gather(1, index).reshape(batch * heads, width, dim) for table in ctx.rotary)

        flat = keys.reshape(batch * heads, 1, width, dim)
        turned = rotate(unrotate(flat, *tables_at(columns)), *tables_at(targets)).reshape(keys.shape)
        return turned.masked_fill((columns < 0)[..., None], 0)
