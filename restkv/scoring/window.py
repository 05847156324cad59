"""Shared scoring machinery: observation-window attention, GQA group reduction, pooling.

Every tensor here is batched and padding-aware. Prompts are left-padded; ``valid[b, j]``
says whether column ``j`` of row ``b`` holds a real token. Scores are float32 whatever
the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def window_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    valid: torch.Tensor,
    num_queries: int,
    scaling: float,
    softcap: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of the last ``num_queries`` prompt queries over every key, in float32.

    Parameters
    ----------
    query: ``[B, H, n, d]`` post-RoPE queries of the last ``n >= num_queries`` prompt tokens.
    key: ``[B, H_kv, N, d]`` post-RoPE keys; query head ``h`` reads KV head ``h // G``.
    valid: ``[B, N]`` bool, real (non-padding) columns.
    num_queries: how many of the newest queries to use (clamped to ``N``).

    Returns
    -------
    ``[B, H, w, N]`` softmax weights (causal, padding and sliding window masked). Rows of
    padding queries are all zero instead of NaN.
    """
    batch, num_heads, given, head_dim = query.shape
    length, num_kv_heads = key.shape[2], key.shape[1]
    groups = num_heads // num_kv_heads
    w = min(num_queries, length)
    q = query[:, :, given - w :, :].float().reshape(batch * num_kv_heads, groups * w, head_dim)
    k = key.float().reshape(batch * num_kv_heads, length, head_dim).transpose(-1, -2)
    # The scale is applied inside the matmul (one pass over the [H, w, N] logits, not two).
    logits = torch.baddbmm(q.new_empty(()), q, k, beta=0.0, alpha=scaling).view(batch, num_heads, w, length)
    if softcap is not None:
        logits = logits.div_(softcap).tanh_().mul_(softcap)
    visible = key_visibility(valid, w, sliding_window)
    weights = torch.softmax(logits.masked_fill_(~visible[:, None], torch.finfo(logits.dtype).min), dim=-1)
    padding_queries = ~valid[:, length - w :]
    if bool(padding_queries.any()):  # a padding query sees no key: zero its uniform softmax row
        weights.masked_fill_(padding_queries[:, None, :, None], 0.0)
    return weights


def key_visibility(valid: torch.Tensor, num_queries: int, sliding_window: int | None = None) -> torch.Tensor:
    """``[B, w, N]`` bool: which keys each of the last ``w`` queries may attend to."""
    length = valid.shape[-1]
    q_pos = torch.arange(length - num_queries, length, device=valid.device)[:, None]
    k_pos = torch.arange(length, device=valid.device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed = allowed & (k_pos > q_pos - sliding_window)
    query_valid = valid[:, length - num_queries :]
    return allowed[None] & valid[:, None, :] & query_valid[:, :, None]


def reduce_groups(scores: torch.Tensor, num_kv_heads: int, how: str = "mean") -> torch.Tensor:
    """Reduce per-query-head scores ``[B, H, N]`` to one score per KV head ``[B, H_kv, N]``.

    Query heads ``k*G .. k*G+G-1`` share KV head ``k`` (transformers' ``repeat_kv`` order).
    """
    batch, num_heads, length = scores.shape
    grouped = scores.view(batch, num_kv_heads, num_heads // num_kv_heads, length)
    if how == "mean":
        return grouped.mean(dim=2)
    if how == "max":
        return grouped.amax(dim=2)
    if how == "sum":
        return grouped.sum(dim=2)
    raise ValueError(f"unknown group reduction {how!r}; choose mean, max or sum")


def pool_scores(scores: torch.Tensor, candidates: torch.Tensor, pooling: str, kernel_size: int) -> torch.Tensor:
    """Smooth ``[B, H_kv, N]`` scores along positions, over the candidate region only.

    Non-candidate columns (padding, the protected window) act as the padding of the
    reference's pooling over the past tokens: zeros counted in the divisor for
    ``avgpool`` (PyTorch ``count_include_pad=True``), ``-inf`` for ``maxpool``. A left-padded
    row therefore pools exactly as the same row alone.
    """
    if pooling == "none" or kernel_size == 1:
        return scores
    batch, heads, length = scores.shape
    mask = candidates[:, None, :].expand_as(scores)
    if pooling == "avgpool":
        flat = scores.masked_fill(~mask, 0.0).reshape(batch * heads, 1, length)
        pooled = F.avg_pool1d(flat, kernel_size, stride=1, padding=kernel_size // 2, count_include_pad=True)
    elif pooling == "maxpool":
        flat = scores.masked_fill(~mask, float("-inf")).reshape(batch * heads, 1, length)
        pooled = F.max_pool1d(flat, kernel_size, stride=1, padding=kernel_size // 2)
    else:
        raise ValueError(f"pooling {pooling!r} is not a plain pooling; choose none, avgpool or maxpool")
    return pooled.view(batch, heads, length)
