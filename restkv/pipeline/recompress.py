"""Compressing a compressed layer again: chunked prefill and compression during decoding.

``--prefill_chunk_size N`` feeds the prompt in chunks of ``N`` tokens (the patched decoder
forward splits it, ``restkv.integrations.transformers.attention.model_forward``); after every chunk each layer scores
what it holds (the tokens it kept so far plus the new chunk) with the newest ``window_size``
queries and evicts down to the whole prompt's budget (``restkv.integrations.transformers.deferred.chunk_budgets``), so
no layer ever holds more than ``budget + N`` entries. ``--decode_budget B`` does the same every ``--decode_interval K``
generated tokens with the queries of the newest ``window_size`` tokens, keeping every layer at
most ``B + K`` entries after its first compression however long the generation (before it, what the prompt's
compression kept plus ``K``). ``--decode_compression_ratio R`` keeps ``floor(seen (1 - R))`` of the ``seen``
tokens instead, ``--decode_method`` scores these compressions with another method, and a scorer of each token
alone ranks the scores its tokens got as they came (``compress_decoding``).

A layer's heads may hold different tokens, so each KV head's exact tokens (kept, then appended,
in position order) form its own sequence, right-aligned; the one pipeline
(``restkv.pipeline.compress.compress_layer``) then compresses the layer as a single-pass prefill would,
the sequences standing for the prompt (``LayerInputs.positions`` maps each back to its
padded-batch column). When every head of a row holds as many tokens (uniform budgets), the
sequences line up and the whole layer is one compression; otherwise each head is scored on its
own and the allocation shares the row's budget over the heads (a head-adaptive one sees each
head's own candidates).

A score that is fixed once its token is read (the reconstruction observation's, KVzip's; a
learned scorer's; any scorer that reads no queries) need not be computed again: under chunked
prefill such a layer keeps its kept tokens' scores (``CompressedLayer.token_scores``) and
``rank_chunk`` ranks them beside the new chunk's (``restkv.integrations.transformers.deferred`` scores the chunk),
across every layer and KV head when the allocation is model-wide, as the single pass would rank the
same scores. Only what stays protected whatever follows (the template around the context) is
stored as +inf; the window a ranking protects is the newest tokens' of that moment.

Summaries absorb what a later compression evicts: the layer's summary segments are handed to
the pipeline (``previous``) and their part folds the new evictions in (ResKV's entries by
weighted k-means, ``restkv.switches.residual``), so the layer never holds more than the budget plus the
new tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from restkv.cache.segments.exact import exact_tokens, joined_view
from restkv.config.composition import kept_at_ratio
from restkv.pipeline.compress import LayerState, compress_layer
from restkv.pipeline.inputs import LayerFacts, LayerInputs
from restkv.pipeline.plan import LayerShape, RowShape, layer_budgets, plan_layer
from restkv.scoring.selection import gather_columns


@dataclass
class HeldSequences:
    """A layer's exact tokens (kept, then appended) as each KV head's own sequence, in position
    order and right-aligned: ``keys``/``values`` ``[B, H_kv, M, d]``, ``positions`` ``[B, H_kv, M]``
    padded-batch columns (-1 before a shorter head's tokens)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    counts: torch.Tensor  # [B, H_kv] exact tokens
    slots: torch.Tensor  # [B, H_kv] budget slots the summaries take (they stay, absorbing evictions)

    @classmethod
    def of(cls, layer) -> "HeldSequences":
        keys, values, columns = layer.kept_tokens(appended=True)  # each head's tokens first, in position order
        counts = (columns >= 0).sum(dim=-1)
        order = _right_aligned_order(counts)  # [B, H_kv, M] slot of each sequence position, -1 = padding
        positions = torch.where(order >= 0, columns.gather(2, order.clamp(min=0)), -1)
        return cls(gather_columns(keys, order), gather_columns(values, order), positions, counts, layer.summary_slots)

    def fit(self, budgets: list[int]) -> bool:
        """Whether every head of row ``b`` holds at most ``budgets[b]`` entries (summaries counted)."""
        return all(int(c) <= b for row, b in enumerate(budgets) for c in (self.counts + self.slots)[row].tolist())

    @property
    def lined_up(self) -> bool:
        """Whether every head of a row holds as many tokens and summary slots."""
        return bool((self.counts == self.counts[:, :1]).all()) and bool((self.slots == self.slots[:, :1]).all())

    def head_contexts(self, layer, queries: torch.Tensor, config: Any, budgets: list, facts: LayerFacts,
                      layer_idx: int, num_layers: int, protected: torch.Tensor | None = None,
                      query_rotary=None) -> list[LayerInputs]:
        """One ``LayerInputs`` per KV head over its own sequence (``queries`` ``[B, H, w, d]``: the
        newest tokens'), each row keeping ``budgets`` (the layer's, ``layer_budgets``; or per row a list of each
        head's); ``protected``
        ``[B, H_kv, M]``: tokens kept whatever their score."""
        num_kv_heads = self.counts.shape[1]
        groups = queries.shape[1] // num_kv_heads
        contexts = []
        for head in range(num_kv_heads):
            plan = plan_layer(config, self.positions[:, head] >= 0, layer_idx, num_layers,
                              budgets=[(b[head] if isinstance(b, list) else b) - int(s)
                                       for b, s in zip(budgets, self.slots[:, head].tolist())],
                              seen=seen_tokens(layer))
            if protected is not None:
                plan = dataclasses.replace(plan, protected=plan.protected | protected[:, head])
            head_facts = dataclasses.replace(
                facts, o_proj_weight=_group_columns(facts.o_proj_weight, head, num_kv_heads, queries.shape[1]))
            contexts.append(LayerInputs(
                queries[:, head * groups : (head + 1) * groups], self.keys[:, head : head + 1],
                self.values[:, head : head + 1], plan, head_facts,
                positions=self.positions[:, head : head + 1], prompt_padding=layer.prompt_padding,
                query_rotary=query_rotary))
        return contexts


def recompress(layer, queries: torch.Tensor, config: Any, budgets: list[int], facts: LayerFacts, layer_idx: int,
               num_layers: int, query_rotary=None) -> None:
    """Evict ``layer``'s exact tokens (kept and appended) down to ``budgets[b]`` per KV head (the layer's
    own share of it, ``layer_budgets``; summary entries counted), scored by ``queries`` ``[B, H, w, d]``
    (the newest tokens' post-RoPE queries; ``query_rotary``: their RoPE tables, for scorers that read them before
    RoPE); the layer is rewritten in place. Nothing happens when every head fits its budget."""
    held = HeldSequences.of(layer)
    budgets = layer_budgets(config, budgets, seen_tokens(layer), layer_idx, num_layers)
    if held.fit(budgets):
        return
    if held.lined_up:  # one compression of the whole layer
        plan = plan_layer(config, held.positions[:, 0] >= 0, layer_idx, num_layers,
                          budgets=[b - int(s) for b, s in zip(budgets, held.slots[:, 0].tolist())],
                          seen=seen_tokens(layer))
        ctx = LayerInputs(queries, held.keys, held.values, plan, facts, positions=held.positions,
                          prompt_padding=layer.prompt_padding, query_rotary=query_rotary)
        layer.replace(compress_layer(config, ctx, previous=layer.summaries))
        return
    contexts = held.head_contexts(layer, queries, config, budgets, facts, layer_idx, num_layers,
                                  query_rotary=query_rotary)
    scores = [config.policy.score(ctx) for ctx in contexts]
    if config.policy.shares_scores_across_heads:  # one kept set per layer
        shared = torch.stack(scores).mean(dim=0)
        scores = [shared] * len(contexts)
    layer.replace(_compress_heads(config, layer, contexts, scores, _head_allocation(config, contexts, scores)))


def decode_budgets(decoding: Any, layer) -> list[int]:
    """Each row's budget per KV head at a compression during generation: ``--decode_budget``, or
    ``floor(seen * (1 - --decode_compression_ratio))`` of the tokens the row has seen (never below what the method
    always keeps plus one)."""
    run = decoding.run
    if run.decode_budget is not None:
        return [run.decode_budget] * len(layer.prompt_padding)
    floor = decoding.policy.protected_count(run.window_size, 0) + 1
    return [max(kept_at_ratio(seen, run.decode_compression_ratio), floor) for seen in seen_tokens(layer)]


def compression_due(layer, new_tokens: int, interval: int) -> bool:
    """Whether a compression during generation is due after a step of ``new_tokens``: every ``interval`` tokens read
    since the prefill (kvpress' ``DecodingPress``: the prompt stays as its prefill left it until then), counted
    from the last due one whether or not it evicted anything, so every row of a batch is compressed at the steps
    it would be alone."""
    layer.decode_tokens += new_tokens
    if layer.decode_tokens < interval:
        return False
    layer.decode_tokens = 0
    return True


def score_arrivals(decoding: Any, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   facts: LayerFacts, layer_idx: int, num_layers: int, rotary=None, hidden=None) -> torch.Tensor:
    """``[B, H_kv, n]`` the scores of a step's ``n`` new tokens (already appended to ``layer``), each scored alone
    (``Policy.scores_each_token_alone``) as it comes, at its own padded-batch column (so the prompt's sinks are
    told apart)."""
    batch, num_kv_heads, count = key.shape[:3]
    valid = torch.ones(batch, count, dtype=torch.bool, device=key.device)
    plan = plan_layer(decoding, valid, layer_idx, num_layers, budgets=[count] * batch)
    first = layer.tokens_seen - count
    positions = (first + torch.arange(count, device=key.device)).expand(batch, num_kv_heads, -1)
    ctx = LayerInputs(query, key, value, plan, facts, positions=positions, prompt_padding=layer.prompt_padding,
                      rotary=rotary, hidden=hidden)
    return decoding.policy.score(ctx).float()


def compress_decoding(layer, decoding: Any, budgets: list[int], facts: LayerFacts, layer_idx: int,
                      num_layers: int) -> None:
    """Compress ``layer`` during generation with the decode config ``decoding`` (``CompressionConfig.decoding``) to
    ``budgets``: a scorer of each token alone ranks the scores its tokens got as they came (``token_scores``,
    ``arrived_scores``); any other scores what the layer holds with its newest queries."""
    if decoding.scores_on_arrival:
        rank_chunk(decoding, {layer_idx: _arrived_chunk(layer, facts)}, budgets, num_layers)
        layer.arrived_scores = None
        return
    recompress(layer, layer.recent_queries, decoding, budgets, facts, layer_idx, num_layers,
               query_rotary=layer.recent_rotary)


def evict_below_threshold(layer, config: Any, threshold: float, facts: LayerFacts, layer_idx: int,
                          num_layers: int) -> None:
    """DMS while decoding (kvpress' ``DMSPress(decoding=True)``): evict the held tokens past the protected window
    whose score, taken as each came, is below ``threshold``; no budget, each KV head keeps what reaches it."""
    chunk = _arrived_chunk(layer, facts)
    held = HeldSequences.of(layer)
    scores = _held_scores(chunk, held)
    window = config.policy.protected_count(config.run.window_size, 0)
    newest = held.positions >= layer.tokens_seen - window
    counts = ((scores >= threshold) | newest | torch.isposinf(scores)).logical_and(held.positions >= 0).sum(dim=-1)
    if bool((counts == held.counts).all()):  # nothing falls below: the tail and its scores keep growing
        return
    floor = window + 1  # a head's plan must exceed its protected tokens; its explicit count says what it keeps
    budgets = [[max(int(c), floor) for c in row] for row in counts.tolist()]
    contexts = held.head_contexts(layer, chunk.queries, config, budgets, facts, layer_idx, num_layers)
    _rebuild(config, layer, held, contexts, [scores[:, head : head + 1] for head in range(len(contexts))],
             [counts[:, head : head + 1] for head in range(len(contexts))], torch.zeros_like(newest))
    layer.arrived_scores = None


def _arrived_chunk(layer, facts: LayerFacts) -> "ScoredChunk":
    """The tokens appended since the layer's last compression with the scores they got as they came."""
    scores = layer.arrived_scores
    protected = torch.zeros(scores.shape[0], scores.shape[-1], dtype=torch.bool, device=scores.device)
    return ScoredChunk(layer, scores, protected, layer.recent_queries, facts)


def remember_newest(layer, config: Any, query: torch.Tensor, rotary=None) -> None:
    """Keep what the layer's next compression scores with: the newest ``--window_size`` queries, or, for a method
    that models the queries to come (``reads_every_query``), those since the last compression during generation
    (kvpress' buffer) and their RoPE tables ``(cos, sin)`` ``[B, q, d]``."""
    decoding = config.decoding
    if decoding is not None and decoding.policy.reads_every_query:
        layer.remember_queries(query, max(decoding.run.window_size, decoding.run.decode_interval, 2), rotary)
    else:
        layer.remember_queries(query, config.run.window_size)


def seen_tokens(layer) -> list[int]:
    """The tokens each row of ``layer`` (a ``CompressedLayer``) has seen: its prompt so far and the
    generated ones, of which it holds only some (what a layer's own budget counts)."""
    return (layer.tokens_seen - layer.prompt_padding).tolist()


def _head_allocation(config, contexts: list[LayerInputs], scores: list[torch.Tensor]) -> list:
    """Each head's kept counts ``[B, 1]`` when the allocation shares the row's budget over the heads,
    else None for each (every head allocates its own)."""
    if not config.allocator.head_adaptive:
        return [None] * len(contexts)
    ctx = contexts[0]
    shared_keep = _allocate(config, contexts, scores, ctx.layer_idx, ctx.num_layers,
                            ctx.query.shape[1] * len(contexts))
    return [shared_keep[:, head : head + 1] for head in range(len(contexts))]


def _compress_heads(config, layer, contexts: list[LayerInputs], scores: list[torch.Tensor],
                    keep: list) -> LayerState:
    """The layer's state from each KV head's own compression (its summaries absorbing what it evicts)."""
    return _joined_heads([compress_layer(config, ctx, head_scores, head_keep,
                                         previous=[summary.heads(head) for summary in layer.summaries])
                          for head, (ctx, head_scores, head_keep) in enumerate(zip(contexts, scores, keep))])


@dataclass
class ScoredChunk:
    """A layer's newest prompt chunk, scored once (``restkv.integrations.transformers.deferred``): its tokens are the
    ones appended since the layer's last compression."""

    layer: Any  # the CompressedLayer holding it
    scores: torch.Tensor  # [B, H_kv, n] the chunk's token scores
    protected: torch.Tensor  # [B, n] tokens kept whatever their score
    queries: torch.Tensor  # [B, H, w, d] the chunk's newest queries
    facts: LayerFacts


def rank_chunk(config: Any, chunks: dict[int, ScoredChunk], budgets: list[int], num_layers: int) -> None:
    """Compress every layer of ``chunks`` to ``budgets[b]`` per KV head, ranking the tokens it kept
    (by the scores it keeps, ``CompressedLayer.token_scores``) beside its new chunk's, across the
    model when the allocation is model-wide. For a method whose token scores never change once
    computed (KVzip's reconstruction, a learned scorer), this is the ranking the whole prompt's
    single pass would make of the same scores, reached holding at most the budget plus one chunk."""
    prepared = {}
    for index, chunk in chunks.items():
        held = HeldSequences.of(chunk.layer)
        scores = _held_scores(chunk, held)
        protected = torch.isposinf(scores)
        contexts = held.head_contexts(chunk.layer, chunk.queries, config,
                                      layer_budgets(config, budgets, seen_tokens(chunk.layer), index, num_layers),
                                      chunk.facts, index, num_layers, protected)
        scores = scores.masked_fill(protected, 0.0)
        prepared[index] = (held, contexts, [scores[:, head : head + 1] for head in range(len(contexts))], protected)
    if config.allocator.model_wide:  # one ranking over every (layer, KV head)
        keyed = {(index, head): (ctx, s) for index, (_, contexts, scores, _) in prepared.items()
                 for head, (ctx, s) in enumerate(zip(contexts, scores))}
        won = config.allocator.allocate_model({key: pair[0] for key, pair in keyed.items()},
                                              {key: pair[1] for key, pair in keyed.items()})
        keeps = {index: [won[(index, head)] for head in range(len(contexts))]
                 for index, (_, contexts, _, _) in prepared.items()}
    else:
        keeps = {index: _head_allocation(config, contexts, scores)
                 for index, (_, contexts, scores, _) in prepared.items()}
    for index, (held, contexts, scores, protected) in prepared.items():
        _rebuild(config, chunks[index].layer, held, contexts, scores, keeps[index], protected)


def _rebuild(config, layer, held: HeldSequences, contexts: list[LayerInputs], scores: list[torch.Tensor],
             keep: list, protected: torch.Tensor) -> None:
    """Compress each KV head of ``layer`` to ``keep`` by its held tokens' ``scores`` and store the kept ones'
    scores for the next ranking. Only what stays protected whatever follows (``protected``: the template around
    the context) is stored as +inf; the window a ranking protects is the newest tokens' now, and competes later."""
    layer.replace(_compress_heads(config, layer, contexts, scores, keep))
    joined = torch.cat(scores, dim=1).masked_fill(protected, float("inf"))
    layer.token_scores = scores_at(joined, held.positions, layer.kept_columns)


def _held_scores(chunk: ScoredChunk, held: HeldSequences) -> torch.Tensor:
    """``[B, H_kv, M]`` the score of each held token in sequence order: the kept ones' stored
    scores, the chunk's new ones (+inf: protected; -inf: padding)."""
    layer = chunk.layer
    new_scores = chunk.scores.float().masked_fill(chunk.protected[:, None], float("inf"))
    first = layer.tokens_seen - new_scores.shape[-1]
    kept_columns = layer.kept_columns.long()
    stored = layer.token_scores if layer.token_scores is not None else kept_columns.new_zeros(kept_columns.shape,
                                                                                             dtype=torch.float32)
    kept = scores_at(stored, kept_columns, held.positions.long())
    fresh = new_scores.gather(2, (held.positions.long() - first).clamp(0, new_scores.shape[-1] - 1))
    return torch.where(held.positions >= first, fresh, kept).masked_fill(held.positions < 0, float("-inf"))


def scores_at(scores: torch.Tensor, columns: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
    """``[B, H_kv, K]`` the scores of the tokens at padded-batch columns ``wanted`` (-1: none, gets
    -inf), looked up in ``scores`` ``[B, H_kv, S]`` of the tokens at ``columns`` (-1: unused slot);
    a column not among ``columns`` gets -inf."""
    keys = torch.where(columns >= 0, columns.long(), torch.iinfo(torch.long).max)
    ordered, order = torch.sort(keys, dim=-1)
    slot = torch.searchsorted(ordered.contiguous(), wanted.long().contiguous()).clamp(max=ordered.shape[-1] - 1)
    found = (ordered.gather(2, slot) == wanted.long()) & (wanted >= 0)
    picked = scores.float().gather(2, order.gather(2, slot))
    return picked.masked_fill(~found, float("-inf"))


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


def _allocate(config, contexts: list[LayerInputs], scores: list[torch.Tensor], layer_idx: int,
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
