"""StreamingLLM (Xiao et al., 2023, arXiv 2309.17453), prefill-only.

Keeps the first ``n_sink`` tokens (attention sinks) and the most recent
``budget - n_sink``; scores play no part and every head keeps the same positions, at their
original RoPE positions. ``--n_sink`` defaults to 4, which is what the original ReST-KV
release's LongBench, RULER and InfiniteBench runners did (they set the window to
``budget - 4``); only its needle runner kept the first ``budget - window`` tokens plus the
window, i.e. ``--n_sink`` = max_capacity_prompts - window_size. ``--n_sink 0`` keeps the
last ``budget`` tokens. ``--window_size`` plays no part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import register
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import KeepsSinks, Policy


@register("method")
@dataclass(frozen=True)
class StreamingLLM(KeepsSinks, Policy):
    name = "streamingllm"
    reference = "StreamingLLM: Xiao et al., 2023, arXiv 2309.17453"
    ranks_by_position = True
    observes_queries = False


    def protected_count(self, window_size: int, budget: int) -> int:
        return max(budget - self.n_sink, 0)

    def check(self, config) -> None:
        self.check_sinks(config)  # not the window check: the recent tokens here are budget - n_sink

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        # Earlier tokens rank higher, so the top `n_sink` candidates are the first real tokens.
        length = ctx.valid.shape[-1]
        earliest_first = -torch.arange(length, device=ctx.valid.device, dtype=torch.float32)
        return earliest_first.expand(ctx.valid.shape[0], ctx.num_kv_heads, length)
