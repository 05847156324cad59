"""KeyDiff (Park et al., 2025, arXiv 2504.15364): keep the tokens whose keys differ most from the rest.

Score of a token = ``-cos(k_i, a)``, with ``a`` the mean of the row's L2-normalised keys (the
keys as the cache stores them, after RoPE): keys that point away from the average direction
are the distinctive ones and stay. No attention is read, so any attention backend works.

Where this differs from kvpress' ``KeyDiffPress``: the anchor averages the keys of each row's
own tokens (kvpress averages every cached row, which only batch size 1 makes the same), and
the recent ``--window_size`` tokens are kept as for every restkv scorer (kvpress protects
none: ``--window_size 0`` reproduces it). The paper evicts block by block as the prompt is
read, as kvpress' ``BlockPress`` wrapper does: ``--block_press`` here (``restkv.switches.block_press``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from restkv.config.options import register
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import Policy
from restkv.policies.row_local import score_rows


@register("method")
@dataclass(frozen=True)
class KeyDiff(Policy):
    name = "keydiff"
    reference = "KeyDiff: Park et al., 2025, arXiv 2504.15364"
    observes_queries = False

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        def row_scores(row: int, columns: slice) -> torch.Tensor:
            keys = ctx.key[row, :, columns].float()  # [H_kv, n, d]
            anchor = F.normalize(keys, dim=-1).mean(dim=1, keepdim=True)
            return -F.cosine_similarity(keys, anchor, dim=-1)

        return score_rows(ctx, row_scores)
