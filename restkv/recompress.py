"""Compressing a compressed layer again: chunked prefill and compression during decoding.

``--prefill_chunk_size N`` feeds the prompt in chunks of ``N`` tokens (the patched decoder
forward splits it, ``restkv.attention.model_forward``); after every chunk each layer scores
what it holds (the tokens it kept so far plus the new chunk) with the newest ``window_size``
queries and evicts down to the budget of the tokens seen so far, so no layer ever holds more
than ``budget + N`` entries. ``--decode_budget B`` does the same every ``--decode_interval K``
generated tokens with the queries of the newest ``window_size`` tokens, keeping every layer at
most ``B + K`` entries however long the generation.

A layer's heads may hold different tokens, so each KV head's exact tokens (kept, then appended,
in position order) form its own sequence, right-aligned; the one pipeline
(``restkv.compress.compress_layer``) then compresses the layer as a single-pass prefill would,
the sequences standing for the prompt (``ScoringContext.positions`` maps each back to its
padded-batch column). When every head of a row holds as many tokens (uniform budgets), the
sequences line up and the whole layer is one compression; otherwise each head is scored on its
own and the allocation shares the row's budget over the heads (a head-adaptive one sees each
head's own candidates).

Summaries absorb what a later compression evicts: the layer's summary segments are handed to
the pipeline (``previous``) and their part folds the new evictions in (ResKV's entries by
weighted k-means, ``restkv.residual``), so the layer never holds more than the budget plus the
new tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from restkv.allocation import LayerShape, RowShape
from restkv.compress import LayerState, compress_layer
from restkv.context import ScoringContext, plan_layer
from restkv.selection import gather_columns
from restkv.storage import exact_tokens, joined_view


def recompress(layer, queries: torch.Tensor, config: Any, budgets: list[int], scaling: float,
               softcap: float | None, o_proj_weight: torch.Tensor | None, layer_idx: int, num_layers: int) -> None:
    """Evict ``layer``'s exact tokens (kept and appended) down to ``budgets[b]`` per KV head (summary
    entries counted), scored by ``queries`` ``[B, H, w, d]`` (the newest tokens' post-RoPE
    queries); the layer is rewritten in place. Nothing happens when every head fits its budget."""
    keys, values, columns = layer.kept_tokens(appended=True)  # each head's tokens first, in position order
    counts = (columns >= 0).sum(dim=-1)  # [B, H_kv] exact tokens
    slots = layer.summary_slots  # [B, H_kv] token slots the summaries take (they stay, absorbing evictions)
    if all(int(c) <= b for row, b in enumerate(budgets) for c in (counts + slots)[row].tolist()):
        return
    order = _right_aligned_order(counts)  # [B, H_kv, M] slot of each sequence position, -1 = padding
    sequence_keys, sequence_values = gather_columns(keys, order), gather_columns(values, order)
    positions = torch.where(order >= 0, columns.gather(2, order.clamp(min=0)), -1)
    batch, num_kv_heads = counts.shape
    if bool((counts == counts[:, :1]).all()) and bool((slots == slots[:, :1]).all()):
        # The sequences line up: one compression of the whole layer.
        plan = plan_layer(config, order[:, 0] >= 0, layer_idx, num_layers,
                          budgets=[b - int(s) for b, s in zip(budgets, slots[:, 0].tolist())])
        ctx = ScoringContext.of(queries, sequence_keys, sequence_values, plan, scaling, softcap, o_proj_weight,
                                positions=positions, prompt_padding=layer.prompt_padding)
        layer.replace(compress_layer(config, ctx, previous=layer.summaries))
        return
    groups = queries.shape[1] // num_kv_heads
    contexts = []
    for head in range(num_kv_heads):
        plan = plan_layer(config, order[:, head] >= 0, layer_idx, num_layers,
                          budgets=[b - int(s) for b, s in zip(budgets, slots[:, head].tolist())])
        contexts.append(ScoringContext.of(
            queries[:, head * groups : (head + 1) * groups], sequence_keys[:, head : head + 1],
            sequence_values[:, head : head + 1], plan, scaling, softcap,
            _group_columns(o_proj_weight, head, num_kv_heads, queries.shape[1]), positions=positions[:, head : head + 1],
            prompt_padding=layer.prompt_padding))
    scores = [config.policy.score(ctx) for ctx in contexts]
    if config.policy.shares_scores_across_heads:  # one kept set per layer
        shared = torch.stack(scores).mean(dim=0)
        scores = [shared] * num_kv_heads
    keep = [None] * num_kv_heads  # each head's own allocation
    if config.allocator.head_adaptive:  # the row's budget shared over the heads
        shared_keep = _allocate(config, contexts, scores, layer_idx, num_layers, queries.shape[1])
        keep = [shared_keep[:, head : head + 1] for head in range(num_kv_heads)]
    states = [compress_layer(config, ctx, head_scores, head_keep,
                             previous=[summary.heads(head) for summary in layer.summaries])
              for head, (ctx, head_scores, head_keep) in enumerate(zip(contexts, scores, keep))]
    layer.replace(_joined_heads(states))


def _joined_heads(states: list[LayerState]) -> LayerState:
    """One layer's state from each KV head's (``[B, 1, ...]`` segments), heads in order."""
    views = [joined_view(state.kept) for state in states]
    width = max(view[0].shape[2] for view in views)

    def padded(part: int, fill: float) -> torch.Tensor:
        return torch.cat([torch.nn.functional.pad(view[part], (0, 0, 0, width - view[part].shape[2]) if part < 2
                                                  else (0, width - view[part].shape[2]), value=fill)
                          for view in views], dim=1)

    kept = [exact_tokens(padded(0, 0), padded(1, 0), padded(2, -1))]
    summaries = []
    for index in range(len(states[0].summaries)):
        parts = [state.summaries[index] for state in states]
        summaries.append(type(parts[0]).joined_heads(parts))
    return LayerState(kept, summaries)


def _right_aligned_order(counts: torch.Tensor) -> torch.Tensor:
    """``[B, H_kv, M]``: for each row and head, the slots (``0 .. counts - 1``: its tokens, first in
    its padded view) right-aligned in ``M = counts.max()`` positions, -1 before them."""
    width = int(counts.max())
    offset = torch.arange(width, device=counts.device) - (width - counts)[..., None]
    return offset.masked_fill(offset < 0, -1)


def _group_columns(o_proj_weight: torch.Tensor | None, head: int, num_kv_heads: int, num_heads: int):
    """The columns of ``o_proj.weight`` ``[D, H*d]`` read by KV head ``head``'s query heads."""
    if o_proj_weight is None:
        return None
    head_dim = o_proj_weight.shape[1] // num_heads
    groups = num_heads // num_kv_heads
    return o_proj_weight[:, head * groups * head_dim : (head + 1) * groups * head_dim]


def _allocate(config, contexts: list[ScoringContext], scores: list[torch.Tensor], layer_idx: int,
              num_layers: int, num_heads: int) -> torch.Tensor:
    """``[B, H_kv]`` tokens each head keeps (protected included): the row's budget (the heads'
    mean, when summaries lowered some) shared over heads whose candidate sequences differ."""
    num_kv_heads, batch = len(contexts), contexts[0].valid.shape[0]
    shape_of_layer = LayerShape(layer_idx, num_layers, num_heads, num_kv_heads)
    keep = torch.zeros(batch, num_kv_heads, dtype=torch.long)
    for row in range(batch):
        candidates = [ctx.candidates[row] for ctx in contexts]
        protected = [int(ctx.protected[row].sum()) for ctx in contexts]
        available = torch.tensor([int(mask.sum()) for mask in candidates])
        budget = round(sum(int(ctx.budgets[row]) for ctx in contexts) / num_kv_heads)
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
