"""ReST-KV's adaptive spatial smoothing (``--pooling adaptive``, arXiv 2605.08840).

When the attention of the observation window drifts across the prompt as the window
advances, the tokens that later queries will need sit next to the ones the window
attends to now. The adaptive pooling widens the averaging kernel and shifts it in the
direction of that drift:

1. Drift statistic ``t`` per query head: mean position of each window query's top
   ``budget - window`` keys, averaged over the first half of the window, minus the same
   for the second half (positive: attention moves toward the start of the prompt).
   Averaged over a query group to one ``t`` per KV head, computed per batch row.
2. Kernel ``max(kernel_size, 2 * floor(|t| / scale) + 1)`` and shift ``floor(t / scale)``
   (``+ 1`` when ``t <= 0``, the release's rule, so ``t = 0`` shifts by one).
3. Each score is replaced by the mean of the scores in a kernel centred ``shift``
   positions later, with the ends of the candidate region replicated.

Unlike the plain ``avgpool`` (zeros counted at the edges), this path replicates the edge
values, as the release does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from restkv.scoring.observation import top_position_sums

if TYPE_CHECKING:
    from restkv.pipeline.inputs import LayerInputs


def attention_shift(weights: torch.Tensor, valid: torch.Tensor, top: int) -> torch.Tensor:
    """Drift of the top-attended positions across the window, per query head.

    Parameters
    ----------
    weights: ``[H, w, N]`` window attention of one batch row (oldest query first).
    valid: ``[N]`` bool, the row's attendable keys (padding is never counted).
    top: how many of the largest weights of each query define its attended positions.

    Returns
    -------
    ``[H]`` float64 on the CPU: mean position over the first ``w // 2`` queries minus the
    mean over the rest. Equals the release's mean of rank-matched index differences for
    even ``w`` and, unlike it, also works for odd ``w``.
    """
    if weights.shape[1] < 2:
        raise ValueError(f"the attention-shift statistic needs at least 2 window queries; got {weights.shape[1]}")
    return drift_of(*top_position_sums(weights, valid, top))


def drift_of(early: torch.Tensor, late: torch.Tensor) -> torch.Tensor:
    """``[H]`` float64 mean position of the early queries' top keys minus the late queries'
    (from ``top_position_sums``: integer sums, then one float64 division each: exact means)."""
    return early[:, 0].double() / early[:, 1] - late[:, 0].double() / late[:, 1]


def kernel_and_shift(shift_statistic: float, scale: float, min_kernel: int) -> tuple[int, int]:
    """Kernel size and shift of one head's adaptive pooling (floor division as in PyTorch)."""
    steps = shift_statistic // scale
    kernel = max(min_kernel, 2 * int(abs(shift_statistic) // scale) + 1)
    shift = int(steps) if shift_statistic > 0 else int(steps) + 1
    return kernel, shift


def shifted_replicate_mean(scores: torch.Tensor, kernel: int, shift: int) -> torch.Tensor:
    """``out[..., j] = mean(scores[..., clip(j + shift + u)] for |u| <= kernel // 2)`` along the last dimension."""
    half = kernel // 2
    if abs(shift) > half:
        raise ValueError(f"shift {shift} exceeds half the kernel ({kernel}); the padding would be negative")
    rows = scores.reshape(-1, 1, scores.shape[-1])
    padded = F.pad(rows, (half - shift, half + shift), mode="replicate")
    return F.avg_pool1d(padded, kernel_size=kernel, stride=1).view(scores.shape)


def adaptive_pool(ctx: "LayerInputs", scores: torch.Tensor, scale: float, min_kernel: int) -> torch.Tensor:
    """Adaptive pooling of per-KV-head ``[B, H_kv, N]`` scores over each row's candidates.

    The drift statistic uses the row's whole budget minus its protected tokens (with a
    layer-dependent allocation, still the global budget, as the release does). Rows that
    keep every token are returned unchanged.
    """
    num_kv_heads = ctx.num_kv_heads
    candidates = ctx.candidates
    pooled = scores.clone()
    # One host transfer for every row's sizes, not several device syncs per row.
    rows = zip(ctx.budgets.tolist(), ctx.protected.sum(dim=-1).tolist(), ctx.plan.visible_counts.tolist())
    for row, (budget, protected, length) in enumerate(rows):
        columns = candidates[row].nonzero().flatten()
        top = budget - protected
        if columns.numel() == 0 or top < 1 or length <= budget:
            continue
        start, stop = int(columns[0]), int(columns[-1]) + 1  # left padding: one contiguous run
        drift = drift_of(*ctx.observation.shift_positions(row, top))
        heads_by_kernel: dict[tuple[int, int], list[int]] = {}
        for head, statistic in enumerate(drift.view(num_kv_heads, -1).mean(dim=-1).tolist()):
            heads_by_kernel.setdefault(kernel_and_shift(statistic, scale, min_kernel), []).append(head)
        for (kernel, shift), heads in heads_by_kernel.items():  # one pooling call per distinct kernel
            pooled[row, heads, start:stop] = shifted_replicate_mean(scores[row, heads, start:stop], kernel, shift)
    return pooled
