"""The compressed cache layer: a list of typed segments read as one softmax, and cache-wide reports.

A compressed layer replaces a ``DynamicLayer`` (or ``DynamicSlidingWindowLayer``) in the
model's ``Cache`` once its prefill is compressed (``CompressedLayer.from_state``, built from
the pipeline's ``restkv.pipeline.compress.LayerState``). It is made of segments, each owned by the part
that made it:

* **token segments** (``kept``, ``TokenSegment``): tokens held whole or stored another way: dense or
  ragged exact tokens (``restkv.cache.segments.exact``), quantised codes (``restkv.quantizers``), pruned
  keys (ThinK, ``restkv.switches.think``). The last one is always exact and takes the tokens
  appended after compression (question chunks, generated tokens): the tail.
* **summaries** (``SummarySegment``): segments that stand for evicted tokens and join the exact tokens'
  softmax their own way: ResKV's residual entries with their gate (``restkv.switches.residual``),
  MomentKV's first-order entry (``restkv.switches.moments``).
* **corrections** (``CorrectionSegment``): what is applied to the attention output afterwards (IndexMem's
  memory, ``restkv.learned.indexmem``), given the exact tokens' log-sum-exp.

Each role is a protocol declared in ``restkv.cache.segments.base``; the layer refuses a segment that does
not implement its role when it is built.

A step (``attend``) appends the new tokens to the tail, reads every exact segment as a
partial attention (``restkv.cache.partial``: output, log-sum-exp, and the peak when a summary asks),
merges the partials exactly by their log-sum-exps, lets each summary join, and applies the
corrections. A layer of one exact segment and nothing else is one fused kernel call; so is a layer
of several token segments that can all write their slots into one buffer (``SlotWriter``: exact
dense tokens, quantised codes dequantised straight into it, ThinK's compact keys scattered to
whole width) while they hold few slots (``GATHER_LIMIT``): each step then reads them with one
kernel call and merges nothing, instead of one call and one log-sum-exp merge per segment.

``tokens_seen`` counts every column processed (padding included, as ``DynamicLayer`` does),
separately from what is stored: transformers derives the next RoPE position from
``get_seq_length()`` when no position ids are passed, so it must return tokens seen.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

from restkv.cache.partial import Partial, Probe, attend_block, merge, workspace
from restkv.cache.segments.base import (CorrectionSegment, SegmentReport, SummarySegment, TokenSegment, checked_segment,
                                        tensor_bytes)
from restkv.cache.segments.dense import DenseTokens
from restkv.cache.segments.exact import exact_tokens, joined_view
from restkv.scoring.rope import unrotate


def new_token_columns(attention_mask, batch: int, first: int, count: int, device) -> torch.Tensor | None:
    """``[B, q]`` int32 padded-batch columns of ``count`` new tokens starting at column ``first``,
    ``-1`` for padding tokens, read from the mask the model built for the step: a 2-D padding
    mask's last columns, or a 4-D mask's diagonal (a real key is seen by its own query). None
    when every new token is real (the columns are then ``first, first + 1, ...``)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:
        real = attention_mask[:, -count:].bool()
    else:
        real = attention_mask[:, 0, -count:, -count:].diagonal(dim1=-2, dim2=-1)
        if real.dtype != torch.bool:
            real = real > torch.finfo(real.dtype).min / 2
    if bool(real.all()):
        return None
    columns = torch.arange(first, first + count, device=device, dtype=torch.int32).expand(batch, -1)
    return columns.masked_fill(~real.to(device), -1)


#: slots a layer's token segments may hold together for a step to gather them into one buffer and read them
#: with one kernel call; above it each segment is read where it lies (copying a long tail every step would cost
#: more than the merge it saves, and quantised segments are then dequantised in bounded blocks)
GATHER_LIMIT = 4096


class CompressedLayer(CacheLayerMixin):
    """One layer's compressed K/V as segments (see the module docstring)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, kept: list, tokens_seen: int, sliding_window: int | None = None, summaries=(),
                 corrections=(), config: Any = None, prompt_padding: torch.Tensor | None = None,
                 seal=None, seal_every: int = 0) -> None:
        super().__init__()
        if not kept or not hasattr(kept[-1], "append"):
            raise ValueError("a compressed layer's last kept segment must be exact (it takes appended tokens)")
        self.kept = [checked_segment(segment, TokenSegment, "a kept segment") for segment in kept]
        self.summaries = [checked_segment(segment, SummarySegment, "a summary") for segment in summaries]
        self.corrections = [checked_segment(segment, CorrectionSegment, "a correction") for segment in corrections]
        #: the ``CompressionConfig`` that built the layer (what a benchmark run checks against its settings)
        self.config = config
        self.tokens_seen = self.prompt_tokens = tokens_seen
        self.seal, self.seal_every = seal, seal_every
        #: appended tokens sealed into stored segments since the last compression
        self.sealed = 0
        batch = self.tail.rows
        #: ``[B]`` left-padding columns of each row's prompt (tokens seen by a row = tokens_seen - padding)
        self.prompt_padding = (prompt_padding if prompt_padding is not None
                               else torch.zeros(batch, dtype=torch.long)).cpu()
        #: ``[B, H, w, d]`` the newest tokens' queries (kept when the layer is compressed again later)
        self.recent_queries: torch.Tensor | None = None
        #: ``(cos, sin)`` ``[B, w, d]`` the RoPE tables of those queries, for scorers that read them before RoPE
        self.recent_rotary: tuple[torch.Tensor, torch.Tensor] | None = None
        #: ``[B, H_kv, t]`` the scores of the tokens appended since the last compression, each scored alone as it
        #: came (``Policy.scores_each_token_alone``), ranked beside ``token_scores`` at the next compression
        self.arrived_scores: torch.Tensor | None = None
        #: tokens read during generation since a compression was last due (``--decode_interval`` counts them,
        #: whether or not that compression evicted anything: kvpress' step counter)
        self.decode_tokens = 0
        #: ``[B, H_kv, S]`` the kept tokens' scores, aligned with ``kept_columns`` (+inf: protected), while a
        #: chunked prefill ranks them again beside each new chunk's (``restkv.pipeline.recompress.rank_chunk``)
        self.token_scores: torch.Tensor | None = None
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.device = self.tail.columns.device
        self.is_initialized = True
        #: per kernel call of a step, the KV head whose cached values each head reads (None: its own), for a
        #: module that hands its kernel values of other heads (DiffLlama); None for every other module
        self.value_views: list[torch.Tensor | None] | None = None
        #: the new keys and values ``update`` was given this step, until the step's first read appends them
        self.incoming: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_state(cls, state, tokens_seen: int, sliding_window: int | None, config: Any,
                   padding: torch.Tensor | None = None, appends: int | None = None) -> "CompressedLayer":
        """The layer that holds a compression's ``LayerState`` (``padding``: each row's left padding;
        ``appends``: the tokens that will follow, when the caller knows, to hold room for exactly them)."""
        layer = cls(state.kept, tokens_seen, sliding_window, state.summaries, state.corrections, config, padding,
                    state.seal, state.seal_every)
        if appends:
            layer.reserve(appends)
        return layer

    @classmethod
    def from_tokens(cls, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor, tokens_seen: int,
                    sliding_window: int | None = None, summaries=(), corrections=()) -> "CompressedLayer":
        """A layer that holds the exact tokens ``keys``/``values`` ``[B, H_kv, S, d]`` at padded-batch
        ``columns`` ``[B, H_kv, S]`` (-1 = unused slot), beside optional summary and correction
        segments: a cache built by hand (tests, notebooks)."""
        return cls([exact_tokens(keys, values, columns)], tokens_seen, sliding_window, summaries, corrections)

    @property
    def tail(self):
        """The exact segment that takes appended tokens (the last kept one)."""
        return self.kept[-1]

    # ----------------------------------------------------------- reading
    def attend(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None, attention_mask,
               scaling: float, softcap: float | None = None, rotary=None, prompt: bool = False,
               value_heads: torch.Tensor | None = None) -> torch.Tensor:
        """Append the new tokens ``key``/``value`` ``[B, H_kv, q, d]`` and attend ``query``
        ``[B, H, q, d]`` over every segment in one softmax. Used for decode steps, for a prompt's
        later chunks (``prompt``: their padding is the rows' left padding) and for a question chunk
        fed after a context-only compression; ``attention_mask`` is the mask the model built for
        this step, ``rotary`` its ``(cos, sin)`` (what a correction that reads queries before RoPE
        undoes). ``key`` None: the step's tokens were appended by an earlier read of the same step
        (a module that calls its kernel twice); ``value_heads``: the KV head whose values each head
        reads (``Probe.value_heads``). Returns ``[B, q, H, d]``."""
        count = query.shape[2]
        first = self.tokens_seen if key is not None else self.tokens_seen - count
        if key is not None:
            columns = new_token_columns(attention_mask, query.shape[0], first, count, query.device)
            if prompt and columns is not None:
                self.prompt_padding = self.prompt_padding + (columns < 0).sum(dim=-1).to(self.prompt_padding)
            self.append(key, value, columns)
        probe = Probe(query, self.tail.kv_heads, first, scaling, softcap, self.sliding_window,
                      value_heads=value_heads)
        output = self.read(probe, rotary)
        self._settle()
        return output

    def read(self, probe: Probe, rotary=None) -> torch.Tensor:
        """``[B, q, H, d]``: the probe's attention over every segment (nothing is appended);
        ``rotary``: the queries' ``(cos, sin)``, for corrections that read them before RoPE."""
        if len(self.kept) == 1 and len(self.summaries) == 1 and not self.corrections and \
                getattr(self.summaries[0], "host", None) is self.tail and self.summaries[0].reads_with_host(probe):
            return probe.interface(self.summaries[0].read_with_host(probe).output).to(probe.query.dtype)
        widths = self._gathered_widths(probe)
        probe.need_lse = (len(self.kept) > 1 and widths is None) or bool(self.summaries) or bool(self.corrections)
        probe.need_peak = any(summary.needs_peak for summary in self.summaries)
        probe.need_count = any(summary.needs_count for summary in self.summaries)
        if widths is not None:
            exact = self._gathered_partial(probe, widths)
        else:
            exact = merge([segment.attend(probe) for segment in self.kept])
        current = exact
        for summary in self.summaries:
            current = summary.join(current, exact, probe)
        output = probe.interface(current.output)
        if self.corrections:
            pre_rope = None if rotary is None else unrotate(probe.query, *rotary)
            for correction in self.corrections:
                output = correction.correct(probe.query, output, probe.per_query_head(exact.lse), pre_rope)
        return output.to(probe.query.dtype)

    def _gathered_widths(self, probe: Probe) -> list[int] | None:
        """Each token segment's slots when this step reads them all from one buffer with one kernel call (see
        the module docstring), else None. A segment takes part by its class's ``write_slots`` (``SlotWriter``;
        looked up on the class: a protocol check would evaluate every property)."""
        if len(self.kept) < 2 or probe.value_heads is not None or \
                not all(hasattr(type(segment), "write_slots") for segment in self.kept):
            return None
        widths = [segment.slot_count for segment in self.kept]
        return widths if sum(widths) <= GATHER_LIMIT else None

    def _gathered_partial(self, probe: Probe, widths: list[int]) -> Partial:
        """Every token segment written into one shared buffer (``restkv.cache.partial.workspace``: nothing
        outlives the step) and read with one kernel call."""
        tail = self.tail
        batch, heads, total = tail.rows, tail.kv_heads, sum(widths)
        keys = workspace("gathered keys", (batch, heads, total, probe.query.shape[-1]), tail.keys.dtype, self.device)
        values = workspace("gathered values", (batch, heads, total, tail.value_dim), tail.values.dtype, self.device)
        columns, start = [], 0
        for segment, width in zip(self.kept, widths):
            columns.append(segment.write_slots(keys[:, :, start : start + width], values[:, :, start : start + width]))
            start += width
        holes = probe.masks_by_position or any(segment.holes for segment in self.kept)
        visible = probe.visibility(torch.cat(columns, dim=-1)) if holes else None
        return attend_block(probe, keys, values, visible)

    # ----------------------------------------------------------- writing
    def append(self, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor | None = None) -> None:
        """Write new tokens ``[B, H_kv, q, d]`` into the tail; they count as seen. ``columns``
        ``[B, q]``: their padded-batch columns (-1 = padding), None when every one is real."""
        self.tail.append(keys, values, self.tokens_seen, columns)
        self.tokens_seen += keys.shape[2]

    def _settle(self) -> None:
        """After a step: a sliding-window layer forgets appended tokens no future query can see; a
        layer that seals (a quantiser) keeps its newest ``seal_every`` tokens exact (KIVI's
        residual window): once its tail holds twice that many, the oldest ``seal_every`` become
        one stored block."""
        tail = self.tail
        if self.sliding_window is not None:
            if tail.appended > self.sliding_window - 1:
                tail.drop_appended(oldest=tail.appended - (self.sliding_window - 1))
            return
        while self.seal is not None and tail.used >= 2 * self.seal_every:
            keys, values, columns = (t[:, :, : self.seal_every].clone() for t in tail.padded())
            self.kept.insert(len(self.kept) - 1, self.seal(keys, values, columns))
            self.sealed += tail.drop_oldest(self.seal_every)

    def remember_queries(self, query: torch.Tensor, count: int,
                         rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Keep the newest ``count`` queries ``[B, H, q, d]`` (what a later compression scores with) and, when
        given, their RoPE tables ``(cos, sin)`` ``[B, q, d]``."""
        joined = query if self.recent_queries is None else torch.cat([self.recent_queries, query], dim=2)
        self.recent_queries = joined[:, :, -count:]
        if rotary is not None:
            rotary = tuple(table.expand(query.shape[0], -1, -1) for table in rotary)
            if self.recent_rotary is not None:
                rotary = tuple(torch.cat(pair, dim=1) for pair in zip(self.recent_rotary, rotary))
            self.recent_rotary = tuple(table[:, -count:] for table in rotary)

    def remember_scores(self, scores: torch.Tensor) -> None:
        """Keep the scores ``[B, H_kv, q]`` of the step's new tokens (``arrived_scores``)."""
        self.arrived_scores = scores if self.arrived_scores is None else torch.cat([self.arrived_scores, scores], -1)

    def replace(self, state) -> None:
        """Hold a new compression's ``LayerState`` (``restkv.pipeline.recompress``): nothing is appended since."""
        self.kept, self.summaries, self.corrections = list(state.kept), list(state.summaries), list(state.corrections)
        self.seal, self.seal_every, self.sealed = state.seal, state.seal_every, 0

    # ----------------------------------------------------------- contents
    @property
    def kept_counts(self) -> torch.Tensor:
        """``[B, H_kv]`` exact tokens kept at the last compression, per row and KV head."""
        return sum(segment.kept_counts() for segment in self.kept)

    @property
    def held_counts(self) -> torch.Tensor:
        """``[B, H_kv]`` exact tokens held (kept and appended since)."""
        return sum(segment.held_counts() for segment in self.kept)

    @property
    def summary_counts(self) -> torch.Tensor:
        """``[B, H_kv]`` summary entries per row and KV head (ResKV's entries, MomentKV's entry)."""
        counts = torch.zeros_like(self.kept_counts)
        for summary in self.summaries:
            counts = counts + summary.counts()
        return counts

    @property
    def summary_slots(self) -> torch.Tensor:
        """``[B, H_kv]`` token slots of the budget the summaries take, per row and KV head."""
        slots = torch.zeros_like(self.kept_counts)
        for summary in self.summaries:
            slots = slots + summary.budget_slots()
        return slots

    @property
    def tail_length(self) -> int:
        """Tokens appended since the last compression that the layer holds (sealed ones included)."""
        return self.tail.appended + self.sealed

    def kept_tokens(self, appended: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, values, columns)`` ``[B, H_kv, S, d]`` of the exact tokens, each head's first in
        position order (dequantised, pruned keys zero-filled); ``appended``: with the tokens
        appended since compression. A temporary copy, for inspection and recompression."""
        return joined_view(self.kept, appended)

    @property
    def keys(self) -> torch.Tensor:
        """transformers' layer contract: the keys the layer holds, ``[B, H_kv, S, d]`` (every exact token,
        appended ones included, as ``kept_tokens(appended=True)``: a copy, for code that reads a layer's
        keys, such as Mllama's check for cached cross-attention states; restkv's attention never does)."""
        return self.kept_tokens(appended=True)[0]

    @keys.setter
    def keys(self, value) -> None:
        _refuse_assignment("keys", value)

    @property
    def values(self) -> torch.Tensor:
        """The values the layer holds, as ``keys``."""
        return self.kept_tokens(appended=True)[1]

    @values.setter
    def values(self, value) -> None:
        _refuse_assignment("values", value)

    @property
    def kept_keys(self) -> torch.Tensor:
        return self.kept_tokens()[0]

    @property
    def kept_values(self) -> torch.Tensor:
        return self.kept_tokens()[1]

    @property
    def kept_columns(self) -> torch.Tensor:
        """``[B, H_kv, S]`` int32 padded-batch column of each kept token (-1: unused slot)."""
        return self.kept_tokens()[2]

    def segments(self) -> list:
        """Every segment: the exact ones, then the summaries, then the corrections."""
        return [*self.kept, *self.summaries, *self.corrections]

    @property
    def storage(self) -> str:
        """How the kept tokens are held: ``exact``, ``kivi 4-bit``, ``keys 38/64 channels``..."""
        return self.kept[0].storage

    def nbytes(self) -> int:
        """Bytes every segment holds (spare capacity for appended tokens included), and those of the
        queries kept for a later compression: the layer's memory."""
        return sum(report.nbytes for report in self.reports()) + self._extra_nbytes()

    def used_nbytes(self) -> int:
        """``nbytes`` of what is stored, the segments' spare capacity left out."""
        return sum(report.used_nbytes for report in self.reports()) + self._extra_nbytes()

    def _extra_nbytes(self) -> int:
        return tensor_bytes([self.recent_queries, self.token_scores, self.arrived_scores,
                             *(self.recent_rotary or ())])

    def reserve(self, appends: int) -> None:
        """Room in the tail for ``appends`` more tokens at once (what a caller that knows the generation's
        length asks for: the question and the new tokens), so a decode step never grows a buffer."""
        self.tail.reserve(appends)

    def reports(self) -> list[SegmentReport]:
        return [segment.report() for segment in self.segments()]

    # ----------------------------------------------------------- CacheLayerMixin
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """transformers' contract, with one meaning: the step's new tokens, handed on as they are. restkv's
        attention backend reads the layer itself: its read of the step appends them (``take_incoming``, with the
        step's padding columns) and attends over every segment. Refused when the last step's tokens were
        never read that way (a kernel other than restkv's read this layer, and they would be lost)."""
        if self.incoming is not None:
            raise RuntimeError("restkv: a compressed cache layer is read by restkv's attention backend; its last new "
                               "tokens were read by another kernel (this model runs attn_implementation "
                               "without restkv: use restkv.compression(model, ...) or the patched family)")
        self.incoming = (key_states, value_states)
        return key_states, value_states

    def take_incoming(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The new tokens ``update`` was given this step, once (``(None, None)`` after): what the step's first read
        appends."""
        incoming, self.incoming = self.incoming, None
        return incoming if incoming is not None else (None, None)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Mirror the layer type this one replaced, so masks built for the whole model agree."""
        if self.sliding_window is None:
            return self.tokens_seen + query_length, 0
        offset = max(self.tokens_seen - self.sliding_window + 1, 0)
        return min(self.tokens_seen, self.sliding_window - 1) + query_length, offset

    def get_seq_length(self) -> int:
        return self.tokens_seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Empty the layer: the next forward through it is a new prefill."""
        self.kept = [DenseTokens.empty(joined_view([self.tail], appended=False)[1][:, :, :0])]
        self.summaries, self.corrections = [], []
        self.seal, self.sealed = None, 0
        self.tokens_seen = self.prompt_tokens = 0
        self.token_scores = self.arrived_scores = None
        self.decode_tokens = 0

    def __copy__(self) -> "CompressedLayer":
        """A snapshot: the segments are shared until either copy writes (``answer_many``)."""
        twin = object.__new__(CompressedLayer)
        twin.__dict__.update(self.__dict__)
        twin.kept = [segment.fork() for segment in self.kept]
        twin.summaries, twin.corrections = list(self.summaries), list(self.corrections)
        return twin

    def _map_batch(self, fn) -> None:
        self.kept = [segment.map_batch(fn) for segment in self.kept]
        self.summaries = [segment.map_batch(fn) for segment in self.summaries]
        self.corrections = [segment.map_batch(fn) for segment in self.corrections]
        self.prompt_padding = fn(self.prompt_padding)
        if self.recent_queries is not None:
            self.recent_queries = fn(self.recent_queries)
        if self.token_scores is not None:
            self.token_scores = fn(self.token_scores)
        if self.arrived_scores is not None:
            self.arrived_scores = fn(self.arrived_scores)
        if self.recent_rotary is not None:
            self.recent_rotary = tuple(fn(table) for table in self.recent_rotary)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest ``-tokens_to_remove`` tokens; only exact appended tokens can be removed."""
        if tokens_to_remove > 0 or -tokens_to_remove > self.tail.appended:
            raise RuntimeError(
                f"a compressed layer can only drop tokens appended after compression and still exact "
                f"({self.tail.appended}); asked for crop({tokens_to_remove})"
            )
        self.tail.drop_appended(newest=-tokens_to_remove)
        self.tokens_seen += tokens_to_remove


def _refuse_assignment(name: str, value) -> None:
    """A compressed layer's keys and values are its segments': ``CacheLayerMixin.__init__``'s empty ``None``
    is all that may be assigned."""
    if value is not None:
        raise AttributeError(f"a compressed layer's {name} are read from its segments; they cannot be assigned")


def native_layer(sliding_window: int | None) -> CacheLayerMixin:
    """A fresh transformers layer of the kind a compressed layer replaced."""
    if sliding_window is not None:
        return DynamicSlidingWindowLayer(sliding_window=sliding_window)
    return DynamicLayer()
