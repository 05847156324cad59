"""Temporal aggregation over the observation-window queries (ReST-KV, arXiv 2605.08840).

The window queries are ordered oldest to newest along the second-to-last dimension; each
mode collapses that dimension with fixed weights:

* ``mean``: the plain average.
* ``ema``: ``m_1 = x_1``, ``m_i = alpha * x_i + (1 - alpha) * m_{i-1}``, result ``m_W``. The
  recursion starts from the oldest query (not from zero), so the weights sum to one and the
  newest query weighs ``alpha``: ``(1 - alpha)^(W-1)`` for the oldest, ``alpha (1 - alpha)^(W-i)``
  for query ``i >= 2``.
* ``inv_ema``: the same recursion run newest to oldest (most weight on the oldest query).
* ``none``: the newest query alone.

The weights are applied in one product instead of ``W`` sequential steps (the step-by-step
recursion costs one pass over the ``[H, N]`` tensor per window query).
"""

from __future__ import annotations

import torch

TEMPORAL_MODES = ("none", "mean", "ema", "inv_ema")


def query_weights(window: int, mode: str, alpha: float) -> torch.Tensor:
    """``[window]`` float64 weight of each window query (oldest first); they sum to one."""
    if window < 1:
        raise ValueError(f"cannot aggregate an empty window (got {window} queries)")
    if mode == "mean":
        return torch.full((window,), 1.0 / window, dtype=torch.float64)
    if mode == "none":
        weights = torch.zeros(window, dtype=torch.float64)
        weights[-1] = 1.0
        return weights
    if mode in ("ema", "inv_ema"):
        age = torch.arange(window - 1, -1, -1, dtype=torch.float64)  # steps until the newest query
        weights = alpha * (1.0 - alpha) ** age
        weights[0] = (1.0 - alpha) ** (window - 1)
        return weights if mode == "ema" else weights.flip(0)
    raise ValueError(f"unknown temporal aggregation {mode!r}; choose one of {', '.join(TEMPORAL_MODES)}")


def aggregate_queries(values: torch.Tensor, mode: str, alpha: float) -> torch.Tensor:
    """Collapse ``values [..., w, N]`` (window queries oldest first) to ``[..., N]`` with ``mode``."""
    weights = query_weights(values.shape[-2], mode, alpha).to(dtype=values.dtype, device=values.device)
    return torch.matmul(weights, values)
