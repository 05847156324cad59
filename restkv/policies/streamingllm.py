"""StreamingLLM (Xiao et al., 2023, arXiv 2309.17453), prefill-only.

Keeps the first ``n_sink`` tokens (attention sinks) and the most recent
``budget - n_sink``; scores play no part and every head keeps the same positions, at
their original RoPE positions. ``--n_sink`` defaults to 4; the original ReST-KV release
kept the first ``budget - window`` tokens plus the window, i.e.
``n_sink = max_capacity_prompts - window_size``.
"""

from __future__ import annotations

import torch

from restkv.policies import register_policy
from restkv.policies.base import Policy, ScoringContext


@register_policy
class StreamingLLM(Policy):
    name = "streamingllm"

    def protected_count(self, config, budget: int) -> int:
        return max(budget - config.n_sink, 0)

    def validate(self, config) -> None:
        from restkv.config import ConfigError

        budget = config.max_capacity_prompts
        if budget is not None and config.n_sink >= budget:
            raise ConfigError(f"--n_sink {config.n_sink} must be smaller than --max_capacity_prompts {budget}")

    def score(self, ctx: ScoringContext) -> torch.Tensor:
        # Earlier tokens rank higher, so the top `n_sink` candidates are the first real tokens.
        length = ctx.valid.shape[-1]
        earliest_first = -torch.arange(length, device=ctx.valid.device, dtype=torch.float32)
        return earliest_first.expand(ctx.valid.shape[0], ctx.num_kv_heads, length)
