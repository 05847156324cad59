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
over the heads (a head-adaptive one sees each head's own candidates).

Residual entries (ResKV, ``--residual``) summarise every token evicted so far. Until a head
holds entries, each step builds them as a single-pass prefill does (the validation proxy,
fed by the step's newest queries, picks the head's residual share of the budget, k-means
clusters what this step evicts). Once it holds ``r`` entries, it keeps ``r`` slots: the
tokens evicted now join them by weighted k-means (``fold_into_entries``: each old entry
weighs its member count, seeded at the old entries), so every entry's key and value stay
the means of all its members, whichever step evicted them. The exact tokens get ``b - r``
of the budget ``b``, so the layer never holds more than the budget plus the new tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from restkv.allocation import LayerShape, RowShape
from restkv.context import ScoringContext, plan_layer
from restkv.residual import fold_into_entries
from restkv.selection import gather_columns, rank_keys, select_columns


def recompress(layer, queries: torch.Tensor, config: Any, budgets: list[int], scaling: float,
               softcap: float | None, o_proj_weight: torch.Tensor | None, layer_idx: int, num_layers: int) -> None:
    """Evict ``layer``'s exact entries (kept tokens and tail) down to ``budgets[b]`` per KV head,
    scored by ``queries`` ``[B, H, w, d]`` (the newest tokens' post-RoPE queries); the layer is
    rewritten in place, its tail emptied. Nothing happens when every head fits its budget."""
    # Each head's exact tokens fill its first slots, its residual entries its last (restkv.storage);
    # the store is read once (a ragged or quantised one rebuilds its padded view on every read).
    held_keys, held_values, held_columns = layer.entries.read()
    width, tail = held_keys.shape[2], layer.tail_length
    counts = (held_columns >= 0).sum(dim=-1)  # [B, H_kv] exact kept tokens
    held = counts + layer.residual_counts
    if all(int(c) + tail <= b for row, b in enumerate(budgets) for c in held[row].tolist()):
        return
    residual = config.switch("residual")
    batch, num_kv_heads = counts.shape
    groups = queries.shape[1] // num_kv_heads
    tail_keys, tail_values = layer.tail
    keys = torch.cat([held_keys, tail_keys], dim=2)
    values = torch.cat([held_values, tail_values], dim=2)
    tail_columns = torch.arange(layer.tokens_seen - tail, layer.tokens_seen, device=keys.device, dtype=torch.int32)
    columns = torch.cat([held_columns, tail_columns.expand(batch, num_kv_heads, -1)], dim=2)
    order = _right_aligned_order(counts, width, tail)  # [B, H_kv, M] index into keys, -1 = padding

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
    summaries = []
    for head, (ctx, head_scores) in enumerate(zip(contexts, scores)):
        head_keep = keep[:, head : head + 1]
        if residual is not None:
            fresh, built, sizes = _residual_sizes(residual, layer, head, ctx, head_scores, head_keep)
            head_keep = torch.maximum(head_keep - sizes[:, None], ctx.protected.sum(dim=-1, keepdim=True))
        chosen = select_columns(rank_keys(head_scores, ctx.visible, ctx.protected, layer_idx), head_keep)
        if residual is not None:
            old = slice(width - layer.residual_width, None)  # the head's residual slots
            summaries.append(_head_summaries(layer.residual_log_counts, held_keys[:, head, old],
                                             held_values[:, head, old], head, ctx, chosen, fresh, built,
                                             residual.residual_iters))
        head_keys, head_values = config.policy.finalize(ctx, chosen, gather_columns(ctx.key, chosen),
                                                        gather_columns(ctx.value, chosen))
        if config.merger is not None:
            head_keys, head_values = config.merger.merge(ctx, chosen, head_keys, head_values)
        positions = torch.where(chosen >= 0, columns[:, head : head + 1].gather(
            2, order[:, head : head + 1].clamp(min=0).gather(2, chosen.clamp(min=0)).long()), -1)
        kept_keys.append(head_keys)
        kept_values.append(head_values)
        kept_columns.append(positions)
    entries = None if residual is None else _stack_summaries(summaries, held_keys)
    layer.replace_exact(_stack(kept_keys), _stack(kept_values), _stack(kept_columns, fill=-1), entries,
                        readout=None if residual is None else residual.readout())


def _residual_sizes(residual, layer, head: int, ctx: ScoringContext, scores: torch.Tensor, keep: torch.Tensor):
    """``(fresh [B], built plan or None, sizes [B])`` for KV head ``head``: rows whose head holds
    no residual entry yet are built afresh (validation + k-means of this step's evictions);
    the others keep their entry count."""
    old = layer.residual_counts[:, head]
    fresh = old == 0
    built = residual.build(ctx, scores, keep) if bool(fresh.any()) else None
    sizes = torch.where(fresh, built.sizes[:, 0] if built is not None else 0, old)
    return fresh, built, sizes


def _head_summaries(log_counts: torch.Tensor | None, old_keys: torch.Tensor, old_values: torch.Tensor, head: int,
                    ctx: ScoringContext, chosen: torch.Tensor, fresh: torch.Tensor, built,
                    iterations: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per row, ``(keys [r, d], values [r, d], counts [r])`` of KV head ``head``'s residual entries
    after this step: the freshly built ones (``built`` exists whenever a row is ``fresh``), or
    the old ones (``old_keys``/``old_values`` ``[B, R, d]``, the layer's ``log_counts``) with this
    step's evicted tokens folded in."""
    rows = []
    for row in range(chosen.shape[0]):
        if bool(fresh[row]):
            used = torch.isfinite(built.log_counts[row, 0])
            rows.append((built.keys[row, 0, used].float(), built.values[row, 0, used].float(),
                         built.log_counts[row, 0, used].exp().round()))
            continue
        used = torch.isfinite(log_counts[row, head])
        entry_keys, entry_values = old_keys[row, used], old_values[row, used]
        entry_counts = log_counts[row, head, used].exp().round()
        evicted = ctx.plan.valid[row].clone()
        evicted[chosen[row, 0][chosen[row, 0] >= 0].long()] = False
        if not bool(evicted.any()):
            rows.append((entry_keys.float(), entry_values.float(), entry_counts))
            continue
        rows.append(fold_into_entries(entry_keys, entry_values, entry_counts, ctx.key[row, 0, evicted],
                                      ctx.value[row, 0, evicted], iterations))
    return rows


def _stack_summaries(summaries: list[list[tuple[torch.Tensor, ...]]], like: torch.Tensor):
    """``(keys, values [B, H_kv, R, d], log_counts [B, H_kv, R])`` of per-head, per-row entries,
    right-aligned in ``R`` slots (the widest head's count); None when no head holds one."""
    width = max(keys.shape[0] for head in summaries for keys, _, _ in head)
    if width == 0:
        return None
    batch, heads, dim = len(summaries[0]), len(summaries), like.shape[-1]
    keys = like.new_zeros(batch, heads, width, dim)
    values = like.new_zeros(batch, heads, width, dim)
    log_counts = torch.full((batch, heads, width), float("-inf"), device=like.device)
    for head, rows in enumerate(summaries):
        for row, (entry_keys, entry_values, counts) in enumerate(rows):
            used = entry_keys.shape[0]
            if used:
                keys[row, head, width - used :] = entry_keys.to(like.dtype)
                values[row, head, width - used :] = entry_values.to(like.dtype)
                log_counts[row, head, width - used :] = counts.log()
    return keys, values, log_counts


def _right_aligned_order(counts: torch.Tensor, slots: int, tail: int) -> torch.Tensor:
    """``[B, H_kv, M]``: for each row and head, the indices (into its ``slots`` kept slots, whose
    first ``counts`` hold its exact tokens, then the tail) of its exact kept tokens followed by
    the tail, right-aligned (left-padded with -1)."""
    width = int(counts.max()) + tail
    slot = torch.arange(width, device=counts.device)
    start = width - (counts + tail)  # [B, H_kv] first used slot
    offset = slot - start[..., None]
    from_kept = (offset >= 0) & (offset < counts[..., None])
    from_tail = offset >= counts[..., None]
    index = torch.where(from_kept, offset, torch.where(from_tail, slots + offset - counts[..., None], -1))
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
