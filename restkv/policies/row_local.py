"""Scoring each row of a padded batch on its own tokens, so it scores as it does alone.

A prompt's tokens are the last columns of its row (left padding); on a sliding-window layer,
or in a layer compressed again, the tokens that compete are the row's last visible columns.
Scorers whose formula depends on where a token sits in its row (partitions, local windows,
chunks) or on statistics over the row (an anchor key, a z-score) score those columns alone.
"""

from __future__ import annotations

from typing import Callable

import torch

from restkv.pipeline.inputs import LayerInputs


def score_rows(ctx: LayerInputs, score_row: Callable[[int, slice], torch.Tensor]) -> torch.Tensor:
    """``[B, H_kv, N]`` float32: row ``b``'s visible columns scored by ``score_row(b, columns)``
    (``[H_kv, n]`` for the ``n`` columns of the slice, oldest first); zero where nothing competes."""
    length = ctx.key.shape[2]
    scores = torch.zeros(ctx.key.shape[:3], dtype=torch.float32, device=ctx.key.device)
    for row, count in enumerate(ctx.plan.visible_counts.tolist()):
        columns = slice(length - count, length)
        scores[row, :, columns] = score_row(row, columns)
    return scores
