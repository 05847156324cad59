"""Compactor (Chari & Van Durme, 2025, arXiv 2507.08143): leverage scores blended with non-causal attention.

Between the row's first ``--n_sink`` tokens (8 here) and its last ``--compactor_recent`` (4),
which always stay (as does the observation window, ``--window_size``, 32 by default as for every
scorer; kvpress protects none: ``--window_size 0`` reproduces it), a token's score is ``b x`` its key's leverage z-score
(``--method leverage``) plus its non-causal chunked attention z-score (``--method noncausal_attn``), both computed over
those middle tokens alone. The blending weight ``b`` is ``--compactor_blending``, by default the
run's ``--compression_ratio`` (kvpress' choice: the more is evicted, the more the outliers
count), or 0.35 under a token budget (``--max_capacity_prompts``; kvpress' own fallback). Query-agnostic: the
context's own queries score it, so it reads every prompt query of a layer at once (no chunked
prefill, decode budget or model-wide allocation), and the keys before RoPE.

Where this differs from kvpress' ``CompactorPress``: what ``--method leverage`` and ``--method
noncausal_attn`` say of theirs (``--noncausal_kvpress_logits`` reproduces its non-causal part);
the kept sinks and recent tokens score above every other token (kvpress pads them with the
middle's maximum, a tie with its best token).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from restkv.config.options import option, redeclared, register
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import SinkOptions
from restkv.policies.leverage import SketchOptions
from restkv.policies.noncausal import NonCausalAttention
from restkv.policies.row_local import score_rows

#: kvpress' blending weight when no compression ratio is given
TOKEN_BUDGET_BLENDING = 0.35


@register("method")
@dataclass(frozen=True)
class Compactor(SketchOptions, SinkOptions, NonCausalAttention):
    name = "compactor"
    reference = "Compactor: Chari & Van Durme, 2025, arXiv 2507.08143"
    needs_rotary = True

    n_sink: int = redeclared(SinkOptions, "n_sink", 8)
    compactor_recent: int = option(4, "Compactor: the row's last tokens, always kept", minimum=0)
    compactor_blending: float | None = option(
        None, "Compactor: weight of the leverage z-score beside the attention's (default: --compression_ratio, or "
        f"{TOKEN_BUDGET_BLENDING} under a token budget)", minimum=0)

    def for_run(self, run) -> "Compactor":
        if self.compactor_blending is not None:
            return self
        ratio = run.compression_ratio
        return dataclasses.replace(self, compactor_blending=TOKEN_BUDGET_BLENDING if ratio is None else ratio)

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        keys = ctx.pre_rope_key

        def row_scores(row: int, columns: slice) -> torch.Tensor:
            count = columns.stop - columns.start
            start = self.sinks_among(ctx, row, count)
            stop = max(count - self.compactor_recent, start)
            middle = slice(columns.start + start, columns.start + stop)
            scores = torch.empty(ctx.num_kv_heads, count, dtype=torch.float32, device=ctx.key.device)
            if stop > start:
                scores[:, start:stop] = (self.compactor_blending * self.leverage(ctx, keys[row, :, middle].float())
                                         + self.row_scores(ctx, row, middle))
            top = scores[:, start:stop].max() + 1 if stop > start else 1.0
            scores[:, :start] = top
            scores[:, stop:] = top
            return scores

        return score_rows(ctx, row_scores)
