"""Non-causal chunked attention (Chari & Van Durme, 2025, arXiv 2507.08143, Compactor's attention part).

The prompt is cut into chunks of ``--noncausal_chunk`` tokens (the row's first token opens the
first chunk, the last one may be shorter). Inside a chunk every query attends to every key of
the chunk, earlier or later (RoPE'd queries and keys, the layer's scale and soft-cap), and a
token's score is the attention its key receives, summed over the chunk's queries, reduced
over each query group (``--gqa_score_agg``), times ``||v_i||``, smoothed by an average pool of
3 tokens (zero beyond the row's ends) and z-scored over the row's heads and tokens. It needs
the queries of every prompt token, so it scores in the prefill's own forward: it cannot wait
for the whole prefill, nor score a layer again.

Where this differs from kvpress' ``NonCausalAttnPress``: kvpress leaves out the ``1/sqrt(d)``
scale, and pads the last chunk with zero queries and keys that it does not mask (the padded
queries spread uniform attention over the chunk's keys; the padded keys take a logit of about 0
from every real query). Here the last chunk is simply shorter; ``--noncausal_kvpress_logits``
reproduces kvpress. The recent ``--window_size`` tokens are kept as for every restkv scorer
(kvpress protects none: ``--window_size 0``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from restkv.config.options import ConfigError, option, register
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import GroupedScores
from restkv.policies.row_local import score_rows


@register("method")
@dataclass(frozen=True)
class NonCausalAttention(GroupedScores):
    name = "noncausal_attn"
    reference = "Compactor's non-causal attention: Chari & Van Durme, 2025, arXiv 2507.08143"
    observes_queries = False

    noncausal_chunk: int = option(256, "NonCausalAttn: tokens per chunk whose queries attend to all its keys",
                                  minimum=1)
    noncausal_kvpress_logits: bool = option(
        False, "NonCausalAttn: kvpress 0.5.5's logits (no 1/sqrt(d) scale, the last chunk zero-padded without a "
        "mask)"
    )

    @property
    def reads_every_query(self) -> bool:
        return True

    def check(self, config) -> None:
        super().check(config)
        run = config.run
        if config.rescores:
            flag = "--prefill_chunk_size" if run.prefill_chunk_size is not None else "--decode_budget"
            raise ConfigError(f"{flag} scores a layer again with its newest queries only; --method {self.name} needs "
                              "the queries of every prompt token")
        if config.compresses_after_prefill:
            raise ConfigError(f"--allocation {run.allocation} compresses after the whole prefill, which keeps only the "
                              f"last prompt queries; --method {self.name} needs the queries of every prompt token")

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        if ctx.query.shape[2] != ctx.key.shape[2]:
            raise ValueError(f"--method {self.name} needs the queries of all {ctx.key.shape[2]} prompt tokens; the "
                             f"scoring context holds {ctx.query.shape[2]}")
        return score_rows(ctx, lambda row, columns: self.row_scores(ctx, row, columns))

    def row_scores(self, ctx: LayerInputs, row: int, columns: slice) -> torch.Tensor:
        """``[H_kv, n]`` z-scored scores of row ``row``'s tokens at ``columns``, scored among themselves."""
        groups = ctx.query.shape[1] // ctx.num_kv_heads
        query = ctx.query[row, :, columns].float()
        key = ctx.key[row, :, columns].float().repeat_interleave(groups, dim=0)
        received = self.received_attention(query, key, ctx.scaling, ctx.softcap)  # [H, n]
        scores = self.reduce(ctx, received[None])[0] * ctx.value[row, :, columns].float().norm(dim=-1)
        pooled = F.avg_pool1d(scores[:, None], kernel_size=3, stride=1, padding=1)[:, 0]
        return (pooled - pooled.mean()) / pooled.std().clamp_min(1e-6)

    def received_attention(self, query: torch.Tensor, key: torch.Tensor, scaling: float,
                           softcap: float | None) -> torch.Tensor:
        """``[H, n]``: attention each key receives from the queries of its chunk (``[H, n, d]`` each)."""
        if self.noncausal_kvpress_logits:
            return kvpress_received_attention(query, key, self.noncausal_chunk)
        chunk = self.noncausal_chunk
        received = []
        for start in range(0, query.shape[1], chunk):
            logits = query[:, start : start + chunk] @ key[:, start : start + chunk].transpose(-1, -2) * scaling
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            received.append(torch.softmax(logits, dim=-1).sum(dim=1))
        return torch.cat(received, dim=-1)


def kvpress_received_attention(query: torch.Tensor, key: torch.Tensor, chunk: int) -> torch.Tensor:
    """kvpress 0.5.5's version of ``received_attention``: unscaled logits; the last chunk padded
    with zero queries and keys, the padded queries' logits set to 0 and the padded keys' to -1e-9."""
    heads, length, dim = query.shape
    padding = -length % chunk
    query = F.pad(query, (0, 0, 0, padding)).view(heads, -1, chunk, dim)
    key = F.pad(key, (0, 0, 0, padding)).view(heads, -1, chunk, dim)
    logits = query @ key.transpose(-1, -2)
    padded = torch.arange(chunk, device=query.device) >= chunk - padding
    logits[:, -1].masked_fill_(padded[:, None], 0.0)
    logits[:, -1].masked_fill_(padded[None, :], -1e-9)
    return torch.softmax(logits, dim=-1).sum(dim=2).flatten(start_dim=1)[:, :length]
