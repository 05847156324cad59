"""DuoAttention (Xiao et al., ICLR 2025, arXiv 2410.10819): retrieval heads keep everything, streaming heads a stream.

Few heads read the whole context; most attend to the first tokens and the newest. DuoAttention
scores every KV head once, offline (its pattern file), and makes the lowest-scored
``--duo_streaming_ratio`` of all the model's KV heads *streaming* heads, which keep what
StreamingLLM keeps at the budget (the first ``--n_sink`` tokens and the newest ``budget -
n_sink``); the others, *retrieval* heads, keep every token. Memory follows the pattern: the
cache holds each head's own count (ragged), not a full-length cache with a mask. A pattern of
DuoAttention's repository comes with its ``sink_size`` and ``recent_size`` (its ``config.json``):
run it with ``--n_sink sink_size --max_capacity_prompts sink_size + recent_size``.

``--duo_pattern FILE``: JSON ``{"head_scores": [[...] per layer], "sink_size": S, "recent_size": R}``
(``python -m restkv.tools.duo_pattern`` writes one for any supported model; the sizes are
informational), or DuoAttention's ``full_attention_heads.tsv`` ([layers x KV heads], tab
separated). Scores are clipped to [0, 1] as DuoAttention's loader does; the
``round(L H_kv ratio)`` lowest stream (ties: the earlier head).

As kvpress' ``DuoAttentionPress`` with a pattern, whose ``head_compression_ratio`` is
``--duo_streaming_ratio``; its pattern-free ``on_the_fly_scoring`` is what the pattern command
computes. The heads keep their counts through a prefill only: chunked prefill and decode
budgets are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from restkv.config.options import register
from restkv.policies.streamingllm import StreamingLLM


@register("method")
@dataclass(frozen=True)
class DuoAttention(StreamingLLM):
    name = "duo_attention"
    reference = "DuoAttention: Xiao et al., ICLR 2025, arXiv 2410.10819"
    allocation = "duo"
