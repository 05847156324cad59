"""Compressing a compressed layer again: chunked prefill and compression during decoding.

``--prefill_chunk_size N`` feeds the prompt in chunks of ``N`` tokens (the patched decoder
forward splits it, ``restkv.attention.model_forward``); after every chunk each layer scores
what it holds (the tokens it kept so far plus the new chunk) with the chunk's last
``window_size`` queries and evicts down to the budget of the tokens seen so far, so no layer
ever holds more than ``budget + N`` entries. ``--decode_budget B`` does the same every
``--decode_interval K`` generated tokens with the queries of the newest ``window_size``
tokens, keeping every layer at most ``B + K`` entries however long the generation.

A layer's kept sets differ per KV head, so each KV head is scored on its own sequence (its
kept tokens, then the new ones, in position order) with the query heads of its group: the
scorers, the window observation and the protection of the newest tokens are the ones of a
single-pass prefill, applied to that sequence. The allocation then shares the row's budget
over the heads (a head-adaptive one sees each head's own candidates). Residual entries
(ResKV) summarise every token evicted so far: the entries of earlier steps and the tokens
evicted now are clustered together, each entry weighing its member count, so an entry's
mean key and value stay the means of all its members.
"""

from __future__ import annotations

from typing import Any

import torch

from restkv.allocation import LayerShape, RowShape
from restkv.context import ScoringContext, plan_layer
from restkv.selection import gather_columns, rank_keys, select_columns


def recompress(layer, queries: torch.Tensor, config: Any, budgets: list[int], scaling: float,
               softcap: float | None, o_proj_weight: torch.Tensor | None, layer_idx: int, num_layers: int) -> None:
    """Evict ``layer``'s exact entries (kept tokens and tail) down to ``budgets[b]`` per KV head,
    scored by ``queries`` ``[B, H, w, d]`` (the newest tokens' post-RoPE queries); the layer is
    rewritten in place, its tail emptied. Nothing happens when every head fits its budget."""
    exact, tail = layer.kept_keys.shape[2] - layer.residual_width, layer.tail_length
    counts = (layer.kept_columns[..., :exact] >= 0).sum(dim=-1)  # [B, H_kv] exact kept tokens
    if all(int(c) + tail <= b for row, b in enumerate(budgets) for c in counts[row].tolist()):
        return
    batch, num_kv_heads = counts.shape
    groups = queries.shape[1] // num_kv_heads
    tail_keys, tail_values = layer.tail
    keys = torch.cat([layer.kept_keys[:, :, :exact], tail_keys], dim=2)
    values = torch.cat([layer.kept_values[:, :, :exact], tail_values], dim=2)
    tail_columns = torch.arange(layer.tokens_seen - tail, layer.tokens_seen, device=keys.device, dtype=torch.int32)
    columns = torch.cat([layer.kept_columns[..., :exact], tail_columns.expand(batch, num_kv_heads, -1)], dim=2)
    order = _right_aligned_order(counts, exact, tail)  # [B, H_kv, M] index into keys, -1 = padding

    kept_keys, kept_values, kept_columns, contexts, scores = [], [], [], [], []
    for head in range(num_kv_heads):
        index = order[:, head]
        sequence_keys = gather_columns(keys[:, head : head + 1], index[:, None])
        sequence_values = gather_columns(values[:, head : head + 1], index[:, None])
        plan = plan_layer(config, index >= 0, layer_idx, num_layers, budgets=budgets)
        group = slice(head * groups, (head + 1) * groups)
        ctx = ScoringContext.of(queries[:, group], sequence_keys, sequence_values, plan, scaling, softcap,
                                _group_columns(o_proj_weight, head, num_kv_heads, queries.shape[1]))
        contexts.append(ctx)
        scores.append(config.policy.score(ctx))
    if config.policy.shares_scores_across_heads:  # one kept set per layer: the sequences line up
        shared = torch.stack(scores).mean(dim=0)
        scores = [shared] * num_kv_heads
    keep = _allocate(config, contexts, scores, layer_idx, num_layers, queries.shape[1])
    for head, (ctx, head_scores) in enumerate(zip(contexts, scores)):
        chosen = select_columns(rank_keys(head_scores, ctx.visible, ctx.protected, layer_idx), keep[:, head : head + 1])
        head_keys, head_values = config.policy.finalize(ctx, chosen, gather_columns(ctx.key, chosen),
                                                        gather_columns(ctx.value, chosen))
        if config.merger is not None:
            head_keys, head_values = config.merger.merge(ctx, chosen, head_keys, head_values)
        positions = torch.where(chosen >= 0, columns[:, head : head + 1].gather(
            2, order[:, head : head + 1].clamp(min=0).gather(2, chosen.clamp(min=0)).long()), -1)
        kept_keys.append(head_keys)
        kept_values.append(head_values)
        kept_columns.append(positions)
    layer.replace_exact(_stack(kept_keys), _stack(kept_values), _stack(kept_columns, fill=-1))


def _right_aligned_order(counts: torch.Tensor, exact: int, tail: int) -> torch.Tensor:
    """``[B, H_kv, M]``: for each row and head, the indices (into kept slots then tail) of its
    exact kept tokens followed by the tail, right-aligned (left-padded with -1)."""
    width = int(counts.max()) + tail
    slot = torch.arange(width, device=counts.device)
    start = width - (counts + tail)  # [B, H_kv] first used slot
    offset = slot - start[..., None]
    from_kept = (offset >= 0) & (offset < counts[..., None])
    from_tail = offset >= counts[..., None]
    index = torch.where(from_kept, offset, torch.where(from_tail, exact + offset - counts[..., None], -1))
    return index.masked_fill(offset < 0, -1)


def _group_columns(o_proj_weight: torch.Tensor | None, head: int, num_kv_heads: int, num_heads: int):
    """The columns of ``o_proj.weight`` ``[D, H*d]`` read by KV head ``head``'s query heads."""
    if o_proj_weight is None:
        return None
    head_dim = o_proj_weight.shape[1] // num_heads
    groups = num_heads // num_kv_heads
    return o_proj_weight[:, head * groups * head_dim : (head + 1) * groups * head_dim]


def _allocate(config, contexts: list[ScoringContext], scores: list[torch.Tensor], layer_idx: int,
              num_layers: int, num_heads: int) -> torch.Tensor:
    """``[B, H_kv]`` tokens each head keeps (protected included), the row's budget shared over
    heads whose candidate sequences differ."""
    num_kv_heads, batch = len(contexts), contexts[0].valid.shape[0]
    shape_of_layer = LayerShape(layer_idx, num_layers, num_heads, num_kv_heads)
    keep = torch.zeros(batch, num_kv_heads, dtype=torch.long)
    for row in range(batch):
        candidates = [ctx.candidates[row] for ctx in contexts]
        protected = [int(ctx.protected[row].sum()) for ctx in contexts]
        available = torch.tensor([int(mask.sum()) for mask in candidates])
        budget = int(contexts[0].budgets[row])
        window = max(protected)
        shape = RowShape(row, budget, window, int(available.max()) + window)
        if shape.candidate_budget >= int(available.max()):
            counts = available
        else:
            padded = torch.full((num_kv_heads, int(available.max())), float("-inf"))
            for head, (mask, head_scores) in enumerate(zip(candidates, scores)):
                padded[head, : int(available[head])] = head_scores[row, 0][mask].float().cpu()
            counts = config.allocator.candidate_counts(shape_of_layer, padded, shape, available).cpu()
        keep[row] = counts + torch.tensor(protected)
    return keep.to(contexts[0].budgets.device)


def _stack(parts: list[torch.Tensor], fill: float = 0) -> torch.Tensor:
    """Concatenate per-head ``[B, 1, K_h, ...]`` tensors along the head dimension, padding every
    head to the widest."""
    width = max(part.shape[2] for part in parts)
    padded = []
    for part in parts:
        grow = width - part.shape[2]
        pad = (0, 0, 0, grow) if part.dim() == 4 else (0, grow)
        padded.append(torch.nn.functional.pad(part, pad, value=fill))
    return torch.cat(padded, dim=1)
