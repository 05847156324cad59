"""The compressed cache layer and cache-wide reports.

A compressed layer replaces a ``DynamicLayer`` (or ``DynamicSlidingWindowLayer``) in the
model's ``Cache`` after the prefill has been compressed (``CompressedLayer.from_selection``).
It owns its read path: ``attend`` appends the new tokens and attends over three segments
that take part in one softmax (``attend_segments``):

* **kept**: the selected prompt tokens, ``[B, H_kv, K, d]`` per KV head (never repeated per
  query head). Rows and heads may keep different counts; slots are padded only up to the
  largest count in the layer and marked by ``kept_columns == -1``.
* **residual**: summary entries of evicted tokens (ResKV, ``restkv.residual``). They live in
  the last ``R`` slots of the kept tensors (a head with ``r`` entries keeps ``m = b - r``
  tokens in its first slots and its entries in its last ``r``), so a layer holds exactly the
  base method's slots; ``residual_log_counts`` ``[B, H_kv, R]`` (float32 ``log c``, ``-inf``
  where the slot holds no entry) marks them, and ``residual_readout`` says how attention reads
  them (count exponent, gate, shared or separate softmax). None without ``--residual``.
* **tail**: tokens appended after compression (question chunk, generated tokens), dense
  ``[B, H_kv, T, d]`` shared by every head, grown by doubling.

Two parts change how the segments are stored, not what attention computes from them:

* ``--quant_method`` (``restkv.quantization``): the kept and residual entries are held as
  packed codes (``restkv.storage.QuantizedEntries``), quantised once after eviction; the
  tail stays exact until ``--quant_residual_length`` tokens have accumulated, then that
  block is quantised (``tail_blocks``; sliding-window layers keep their short tail exact).
  Attention dequantises one block at a time.
* ``--think`` (``restkv.channel_pruning``): the kept and residual keys hold only each head's
  ``key_channels``, which select the query channels that meet them; the newest
  ``--recent_size`` prompt tokens keep whole keys and open the tail.

A method that summarises the tokens it evicts outside the softmax (IndexMem's latent memory)
gives the layer an ``output_correction`` (``OutputCorrection``): after the one softmax it maps
the attention output, with the log-sum-exp of the exact logits, to the corrected output. Its
numbers count against the budget (the method reserves their token-slot equivalents) and
against ``nbytes``; ``cache_report`` shows them as ``extra_slots``.

``tokens_seen`` counts every column processed (padding included, as ``DynamicLayer``
does), separately from what is stored: transformers derives the next RoPE position from
``get_seq_length()`` when no position ids are passed, so it must return tokens seen.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

from restkv.channel_pruning import split_recent
from restkv.quantization import QuantizedTensor
from restkv.residual import ResidualReadout, capped
from restkv.residual.readout import MASKED
from restkv.selection import Selection
from restkv.storage import DenseEntries, entries_for


@dataclass
class Segment:
    """One block of keys/values inside the shared softmax.

    keys, values: ``[B, H_kv, S, d]``, or functions that return them (a quantised block is
    dequantised only when attention reads it). visible: bool, broadcastable to
    ``[B, H_kv, 1, q, S]`` (given as ``[B, H_kv | 1, q | 1, S]``). log_counts: optional
    float32 broadcastable to ``[B, H_kv, G, q, S]`` (given as ``[B, H_kv, 1, 1, S]``): a finite
    value marks the slot as a ResKV residual entry with that log member count, ``-inf`` an
    exact token. key_channels: optional ``[B, H_kv, c]``, the query channels the keys hold
    (ThinK's pruned keys, ``[B, H_kv, S, c]``). value_maps: optional
    ``[B, H_kv, M, d, d]`` query-dependent value terms of the segment's last ``M`` slots: such a slot
    gives query ``q`` the value ``values[s] + scaling * value_maps[s] q`` (MomentKV's first-order
    summary of the evicted tokens).
    """

    keys: torch.Tensor | Callable[[], torch.Tensor]
    values: torch.Tensor | Callable[[], torch.Tensor]
    visible: torch.Tensor
    log_counts: torch.Tensor | None = None
    value_maps: torch.Tensor | None = None
    key_channels: torch.Tensor | None = None


class OutputCorrection(Protocol):
    """What a compressed layer adds to its attention output for the tokens it evicted."""

    def correct(self, query: torch.Tensor, output: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """The corrected output ``[B, q, H, d]`` from the query ``[B, H, q, d]``, the attention
        output ``[B, q, H, d]`` and the log-sum-exp ``[B, H, q]`` of the exact logits."""

    def tensors(self) -> Iterable[torch.Tensor]:
        """Every tensor the correction holds (its bytes are the layer's)."""

    def token_slots(self) -> float:
        """Token-slot equivalents it holds per row and KV head (what it takes from the budget)."""

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "OutputCorrection":
        """The correction with ``fn`` applied along the batch of each of its tensors."""


def _read(tensor: torch.Tensor | Callable[[], torch.Tensor]) -> torch.Tensor:
    return tensor() if callable(tensor) else tensor


#: how residual entries are read when the caller gives no readout: ``beta log c`` with beta = 1,
#: no gate, one softmax
PLAIN_READOUT = ResidualReadout(gate=False)


def readout_of(config: Any) -> ResidualReadout | None:
    """How a config's summary entries are read: the readout of the switch that builds them
    (``--residual``, ``--moments``), None when no switch does."""
    for part in getattr(config, "switches", ()):
        if hasattr(part, "readout"):
            return part.readout()
    return None


def attend_segments(
    query: torch.Tensor,
    segments: list[Segment],
    scaling: float,
    softcap: float | None = None,
    readout: ResidualReadout | None = None,
    with_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query`` ``[B, H, q, d]`` over several segments with ONE softmax.

    K/V stay at ``H_kv`` heads: the ``G`` query heads of a group are stacked instead of
    repeating keys. Logits are computed in the model dtype and normalised in float32, as
    transformers' eager attention does. Residual entries (segments with ``log_counts``) get
    ``beta log c + log g(q)`` per query head, the gate computed from the same logits of the
    exact entries (``readout``, default ``PLAIN_READOUT``). Returns ``[B, q, H, d]`` (the
    interface layout); ``with_lse``: also the float32 log-sum-exp ``[B, H, q]`` of the visible
    logits (residual entries counted as plain logits).
    """
    batch, num_heads, q_len, head_dim = query.shape
    first_keys = _read(segments[0].keys)
    num_kv_heads = first_keys.shape[1]
    groups = num_heads // num_kv_heads
    stacked = query.reshape(batch, num_kv_heads, groups * q_len, head_dim)
    logits = []
    for index, segment in enumerate(segments):
        probe = stacked
        if segment.key_channels is not None:
            probe = stacked.gather(-1, segment.key_channels[:, :, None, :].expand(-1, -1, stacked.shape[2], -1))
        keys = first_keys if index == 0 else _read(segment.keys)
        raw = torch.matmul(probe, keys.transpose(-1, -2)) * scaling
        logits.append(capped(raw.float().view(batch, num_kv_heads, groups, q_len, -1), softcap))
    weights = (readout or PLAIN_READOUT).weights(
        logits, [segment.visible.unsqueeze(2) for segment in segments], [segment.log_counts for segment in segments]
    )
    weights = weights.to(query.dtype).view(batch, num_kv_heads, groups * q_len, -1)
    output = None
    start = 0
    for segment, width in zip(segments, [part.shape[-1] for part in logits]):
        part = torch.matmul(weights[..., start : start + width], _read(segment.values))
        if segment.value_maps is not None:
            part = part + _query_value_terms(weights[..., start : start + width], stacked, segment.value_maps, scaling)
        output = part if output is None else output + part
        start += width
    output = output.view(batch, num_heads, q_len, head_dim).transpose(1, 2)
    if not with_lse:
        return output
    masked = [raw.masked_fill(~segment.visible.unsqueeze(2), MASKED) for raw, segment in zip(logits, segments)]
    return output, torch.logsumexp(torch.cat(masked, dim=-1), dim=-1).view(batch, num_heads, q_len)


def _query_value_terms(weights: torch.Tensor, stacked: torch.Tensor, value_maps: torch.Tensor,
                       scaling: float) -> torch.Tensor:
    """``sum_s w_s * scaling * value_maps[s] q`` over a segment's last ``M`` slots (``weights``
    ``[B, H_kv, Gq, S]``, ``stacked`` queries ``[B, H_kv, Gq, d]``), in float32."""
    mapped = torch.einsum("bkmvd,bkqd->bkqmv", value_maps.float(), stacked.float())
    terms = torch.einsum("bkqm,bkqmv->bkqv", weights[..., -value_maps.shape[2]:].float(), mapped) * scaling
    return terms.to(stacked.dtype)


def tail_visibility(attention_mask, batch: int, q_len: int, tail_length: int, device) -> torch.Tensor:
    """``[B, q, T]`` bool: which tail tokens (the current chunk included, last) each query sees.

    Read from the last ``T`` key columns of the mask the model built for this step (the
    compressed layer reports the uncompressed mask size); causal within the chunk.
    """
    old = tail_length - q_len
    causal = torch.arange(tail_length, device=device)[None, :] <= old + torch.arange(q_len, device=device)[:, None]
    if attention_mask is None:
        return causal[None].expand(batch, -1, -1)
    if attention_mask.dim() == 2:
        return causal[None] & attention_mask[:, None, -tail_length:].bool()
    block = attention_mask[:, 0, -q_len:, -tail_length:]
    if block.dtype != torch.bool:
        block = block > torch.finfo(block.dtype).min / 2
    return block & causal[None]


class CompressedLayer(CacheLayerMixin):
    """One layer's compressed K/V (see the module docstring for the segments)."""

    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        kept_keys: torch.Tensor,
        kept_values: torch.Tensor,
        kept_columns: torch.Tensor,
        tokens_seen: int,
        sliding_window: int | None = None,
        residual_log_counts: torch.Tensor | None = None,
        residual_columns: torch.Tensor | None = None,
        residual_readout: ResidualReadout | None = None,
        config: Any = None,
        prompt_padding: torch.Tensor | None = None,
        output_correction: OutputCorrection | None = None,
        residual_value_maps: torch.Tensor | None = None,
        key_channels: torch.Tensor | None = None,
        quantizer: Any = None,
    ) -> None:
        super().__init__()
        self.residual_log_counts = residual_log_counts
        #: ``[B, H_kv, M, d, d]`` query-dependent value terms of the last ``M`` residual slots (``Segment.value_maps``)
        self.residual_value_maps = residual_value_maps
        #: the ``restkv.quantization`` part that stores entries and full tail blocks, or None (exact)
        self.quantizer = quantizer
        #: ``[B, H_kv, c]`` the key channels the kept keys hold (ThinK), or None (all of them)
        self.key_channels = key_channels
        # Columns index the padded batch (what attention masks index); -1 = no exact token in the slot.
        self.entries = entries_for(kept_keys, kept_values, kept_columns, self.residual_counts_of(kept_columns),
                                   quantizer)
        # Sliding-window layers only: the padded-batch column of each entry's oldest member; an
        # entry is visible while all its members are (int32, -1 = no entry).
        self.residual_columns = None if residual_columns is None else residual_columns.to(torch.int32)
        self.residual_readout = residual_readout
        #: what the layer adds to its attention output for its evicted tokens (None: nothing)
        self.output_correction = output_correction
        #: the ``CompressionConfig`` that built the layer (what a benchmark run checks against its settings)
        self.config = config
        self.tail_keys: torch.Tensor | None = None
        self.tail_values: torch.Tensor | None = None
        #: tail tokens, the quantised blocks (``tail_blocks``, oldest first) and the exact ones after them
        self.tail_length = 0
        self.tail_blocks: list[tuple[QuantizedTensor, QuantizedTensor]] = []
        self.tokens_seen = tokens_seen
        self.prompt_tokens = tokens_seen
        #: ``[B]`` left-padding columns of each row's prompt (tokens seen by a row = tokens_seen - padding)
        self.prompt_padding = (prompt_padding if prompt_padding is not None
                               else torch.zeros(kept_keys.shape[0], dtype=torch.long)).cpu()
        #: ``[B, H, w, d]`` the newest tokens' queries (kept when the layer is compressed during decoding)
        self.recent_queries: torch.Tensor | None = None
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.device = kept_keys.device
        self.is_initialized = True

    @classmethod
    def from_selection(cls, selection: Selection, tokens_seen: int, sliding_window: int | None, config: Any,
                       readout: ResidualReadout | None = None, padding: torch.Tensor | None = None) -> "CompressedLayer":
        """The layer that holds a compressing prefill's ``Selection`` (padded-batch columns;
        ``padding``: each row's left padding), stored as ``config`` says (quantised, pruned keys)."""
        residual = {}
        if selection.residual_log_counts is not None:
            residual = {"residual_log_counts": selection.residual_log_counts, "residual_readout": readout,
                        "residual_value_maps": selection.residual_value_maps}
            if sliding_window is not None:  # entries leave the window with their oldest member
                residual["residual_columns"] = selection.residual_columns
        recent_size = 0
        if selection.key_channels is not None:  # ThinK: the recent tokens, whole, open the tail
            recent_size = config.switch("think").recent_tokens(config)
            selection, recent_keys, recent_values = split_recent(selection, tokens_seen, recent_size, padding)
        layer = cls(selection.keys, selection.values, selection.columns, tokens_seen=tokens_seen - recent_size,
                    sliding_window=sliding_window, config=config, prompt_padding=padding,
                    key_channels=selection.key_channels, quantizer=getattr(config, "quantizer", None),
                    output_correction=selection.output_correction, **residual)
        if recent_size:
            layer.append(recent_keys, recent_values)
            layer.prompt_tokens = tokens_seen
        return layer

    # ----------------------------------------------------------- the kept entries
    @property
    def kept_keys(self) -> torch.Tensor:
        """``[B, H_kv, S, d]`` the padded view of the kept entries (``restkv.storage``)."""
        return self.entries.read()[0]

    @property
    def kept_values(self) -> torch.Tensor:
        return self.entries.read()[1]

    @property
    def kept_columns(self) -> torch.Tensor:
        """``[B, H_kv, S]`` int32 padded-batch column of each exact token (-1: residual or unused slot)."""
        return self.entries.read()[2]

    def residual_counts_of(self, like: torch.Tensor) -> torch.Tensor:
        """``[B, H_kv]`` residual entries per head (they fill the last slots); ``like``: any
        ``[B, H_kv, ...]`` tensor of the layer, for the shape without residual entries."""
        if self.residual_log_counts is None:
            return torch.zeros(like.shape[:2], dtype=torch.long, device=like.device)
        return torch.isfinite(self.residual_log_counts).sum(dim=-1)

    # ----------------------------------------------------------- reading
    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
               scaling: float, softcap: float | None = None) -> torch.Tensor:
        """Append the new tokens ``key``/``value`` ``[B, H_kv, q, d]`` and attend ``query``
        ``[B, H, q, d]`` over kept tokens, residual entries and tail in one softmax.

        Used for decode steps and for a question chunk fed after a context-only compression;
        ``attention_mask`` is the mask the model built for this step. Returns ``[B, q, H, d]``.
        """
        q_len = query.shape[2]
        query_columns = torch.arange(self.tokens_seen, self.tokens_seen + q_len, device=query.device)
        self.append(key, value)
        tail_visible = tail_visibility(attention_mask, query.shape[0], q_len, self.tail_length, query.device)
        segments = self._kept_segments(query_columns) + self._tail_segments(tail_visible[:, None])
        correction = self.output_correction  # it reads the log-sum-exp of the exact logits
        output = attend_segments(query, segments, scaling, softcap, self.residual_readout,
                                 with_lse=correction is not None)
        if correction is not None:
            output = correction.correct(query, *output)
        self.trim_tail_to_window()
        self._quantize_full_tail_blocks()
        return output

    def _kept_segments(self, query_columns: torch.Tensor) -> list[Segment]:
        """The kept slots, one segment per block the store reads (``restkv.storage``); with
        residual entries (in the last ``R`` slots) the segments carry their log-counts (``-inf``
        on the exact slots)."""
        kept_columns, blocks = self.entries.read_blocks()
        visible = (kept_columns >= 0)[:, :, None, :]
        if self.sliding_window is not None:
            visible = visible & (kept_columns[:, :, None, :] > (query_columns[:, None] - self.sliding_window))
        log_counts = None
        if self.residual_width:
            exact_slots = kept_columns.shape[2] - self.residual_width
            entries = torch.isfinite(self.residual_log_counts)[:, :, None, :]
            if self.sliding_window is not None:  # an entry is visible while its oldest member is
                oldest = self.residual_columns[:, :, None, :]
                entries = entries & (oldest > (query_columns[:, None] - self.sliding_window))
            visible = visible | torch.nn.functional.pad(entries, (exact_slots, 0), value=False)
            log_counts = torch.nn.functional.pad(self.residual_log_counts, (exact_slots, 0), value=float("-inf"))
            log_counts = log_counts[:, :, None, None, :]
        segments = [Segment(keys, values, visible[..., start:stop],
                            None if log_counts is None else log_counts[..., start:stop], key_channels=self.key_channels)
                    for start, stop, keys, values in blocks]
        if self.residual_value_maps is not None:  # MomentKV's terms belong to the last slots
            segments[-1] = dataclasses.replace(segments[-1], value_maps=self.residual_value_maps)
        return segments

    def _tail_segments(self, visible: torch.Tensor) -> list[Segment]:
        """The tail: its quantised blocks (dequantised when read), then its exact tokens."""
        segments, start = [], 0
        for keys, values in self.tail_blocks:
            stop = start + keys.shape[-2]
            segments.append(Segment(keys.dequantize, values.dequantize, visible[..., start:stop]))
            start = stop
        exact_keys, exact_values = self.exact_tail
        return segments + [Segment(exact_keys, exact_values, visible[..., start:])]

    # ----------------------------------------------------------- contents
    @property
    def kept_counts(self) -> torch.Tensor:
        """``[B, H_kv]`` prompt tokens kept per row and KV head."""
        return self.entries.exact_counts()

    def statistics_slots(self) -> float:
        """Token slots per KV head held by the query-dependent value terms (a slot = one key and one
        value, ``2 d`` numbers); 0 without them."""
        maps = self.residual_value_maps
        if maps is None:
            return 0.0
        return maps[0, 0].numel() / (2 * maps.shape[-1])

    @property
    def residual_width(self) -> int:
        """``R``: trailing slots of the kept tensors that may hold residual entries."""
        return 0 if self.residual_log_counts is None else self.residual_log_counts.shape[-1]

    @property
    def residual_counts(self) -> torch.Tensor:
        """``[B, H_kv]`` residual entries per row and KV head (0 without residuals)."""
        return self.residual_counts_of(self.kept_counts)

    @property
    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values appended after compression, ``[B, H_kv, T, d]`` (quantised blocks
        dequantised: a temporary copy)."""
        exact_keys, exact_values = self.exact_tail
        if not self.tail_blocks:
            return exact_keys, exact_values
        return (torch.cat([*(keys.dequantize() for keys, _ in self.tail_blocks), exact_keys], dim=2),
                torch.cat([*(values.dequantize() for _, values in self.tail_blocks), exact_values], dim=2))

    @property
    def exact_tail_length(self) -> int:
        """Tail tokens held exactly (after the quantised blocks)."""
        return self.tail_length - sum(keys.shape[-2] for keys, _ in self.tail_blocks)

    @property
    def exact_tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tail tokens held exactly, ``[B, H_kv, T_exact, d]``."""
        if self.tail_keys is None:
            empty = self.entries.empty()
            return empty, empty
        exact = self.exact_tail_length
        return self.tail_keys[:, :, :exact], self.tail_values[:, :, :exact]

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append new tokens to the tail (amortised O(1) per token: the buffer doubles). The
        buffer is rebuilt, dense kept entries first, when it is full or its kept slots are
        stale (new entries: re-compression, batch reordering)."""
        new = key_states.shape[-2]
        exact = self.exact_tail_length
        needed = exact + new
        capacity = 0 if self.tail_keys is None else self.tail_keys.shape[-2]
        if needed > capacity:
            capacity = max(needed, 2 * capacity, 16)
            shape = (*key_states.shape[:2], capacity, key_states.shape[-1])
            grown_keys, grown_values = key_states.new_empty(shape), value_states.new_empty(shape)
            if exact:
                grown_keys[:, :, :exact] = self.tail_keys[:, :, :exact]
                grown_values[:, :, :exact] = self.tail_values[:, :, :exact]
            self.tail_keys, self.tail_values = grown_keys, grown_values
        self.tail_keys[:, :, exact:needed] = key_states
        self.tail_values[:, :, exact:needed] = value_states
        self.tail_length += new
        self.tokens_seen += new

    def _quantize_full_tail_blocks(self) -> None:
        """Quantise the oldest exact tail tokens, ``--quant_residual_length`` at a time, while
        that many have accumulated (not on sliding-window layers, whose tail is bounded)."""
        if self.quantizer is None or self.sliding_window is not None:
            return
        size = self.quantizer.quant_residual_length
        while self.exact_tail_length >= size:
            keys, values = self.tail_keys[:, :, :size], self.tail_values[:, :, :size]
            self.tail_blocks.append((self.quantizer.quantize_keys(keys), self.quantizer.quantize_values(values)))
            rest = self.exact_tail_length
            self.tail_keys[:, :, :rest] = self.tail_keys[:, :, size : size + rest].clone()
            self.tail_values[:, :, :rest] = self.tail_values[:, :, size : size + rest].clone()

    def trim_tail_to_window(self) -> None:
        """Sliding-window layers: forget tail tokens that no future query can see."""
        if self.sliding_window is not None and self.tail_length > self.sliding_window - 1:
            drop = self.tail_length - (self.sliding_window - 1)
            keys, values = self.tail
            self.tail_keys, self.tail_values = keys[:, :, drop:].clone(), values[:, :, drop:].clone()
            self.tail_length -= drop

    def remember_queries(self, query: torch.Tensor, count: int) -> None:
        """Keep the newest ``count`` queries ``[B, H, q, d]`` (what decode-time compression scores with)."""
        joined = query if self.recent_queries is None else torch.cat([self.recent_queries, query], dim=2)
        self.recent_queries = joined[:, :, -count:]

    def replace_exact(self, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor,
                      residual: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                      readout: ResidualReadout | None = None) -> None:
        """Make ``keys``/``values`` ``[B, H_kv, K, d]`` (padded-batch ``columns``, -1 = unused) the
        layer's exact entries and ``residual`` = ``(keys, values [B, H_kv, R, d], log_counts
        [B, H_kv, R])`` its residual entries (None: none), and empty the tail (they now hold its
        tokens). What ``restkv.recompress`` writes after a new eviction; ``readout``: how
        attention reads the entries (``--residual``)."""
        self.residual_log_counts = None if residual is None else residual[2]
        if readout is not None:
            self.residual_readout = readout
        if residual is not None:
            keys = torch.cat([keys, residual[0]], dim=2)
            values = torch.cat([values, residual[1]], dim=2)
            columns = torch.nn.functional.pad(columns, (0, residual[2].shape[-1]), value=-1)
        self.entries = entries_for(keys, values, columns, self.residual_counts_of(columns), self.quantizer)
        self.tail_length = 0
        self.tail_blocks = []

    @property
    def storage(self) -> str:
        """How the entries are held: ``exact``, or the quantisation and the key channels kept."""
        parts = [] if self.quantizer is None else [f"{self.quantizer.name} {self.quantizer.nbits}-bit"]
        if self.key_channels is not None:
            parts.append(f"keys {self.key_channels.shape[-1]}/{self.entries.empty().shape[-1]} channels")
        return ", ".join(parts) or "exact"

    def nbytes(self) -> int:
        """Bytes held by every tensor of the layer: the stored entries (packed codes, scales,
        zero-points and outliers when quantised), the tail's quantised blocks and its exact
        tokens (at their used length)."""
        tensors = list(self.entries.tensors())
        tensors += [t for t in (self.residual_log_counts, self.residual_columns, self.residual_value_maps,
                                self.recent_queries, self.key_channels) if t is not None]
        tensors += [t for keys, values in self.tail_blocks for t in (*keys.tensors(), *values.tensors())]
        tensors += list(self.exact_tail) if self.exact_tail_length else []
        tensors += list(self.output_correction.tensors()) if self.output_correction is not None else []
        return sum(t.numel() * t.element_size() for t in tensors)

    # ----------------------------------------------------------- CacheLayerMixin
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise RuntimeError(
            "this cache layer was compressed by restkv and can only be read by restkv's patched attention; "
            "do not call restkv.unpatch() (or load a new model) while a compressed cache is in use"
        )

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
        empty = self.entries.empty()
        self.entries = DenseEntries(empty, empty, empty[..., 0].to(torch.int32))
        self.residual_log_counts = self.residual_columns = self.key_channels = None
        self.residual_value_maps = self.output_correction = None
        self.tail_keys = self.tail_values = None
        self.tail_blocks = []
        self.tail_length = self.tokens_seen = self.prompt_tokens = 0

    def _map_batch(self, fn) -> None:
        residual_counts = fn(self.residual_counts_of(self.entries.empty()))
        for name in ("residual_log_counts", "residual_columns", "tail_keys", "tail_values", "recent_queries",
                     "prompt_padding", "key_channels", "residual_value_maps"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, fn(tensor))
        self.tail_blocks = [(keys.map_batch(fn), values.map_batch(fn)) for keys, values in self.tail_blocks]
        if self.output_correction is not None:
            self.output_correction = self.output_correction.map_batch(fn)
        self.entries = self.entries.map_batch(fn, residual_counts)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest ``-tokens_to_remove`` tokens; only tokens of the tail can be removed."""
        if tokens_to_remove > 0 or -tokens_to_remove > self.exact_tail_length:
            raise RuntimeError(
                f"a compressed layer can only drop tokens appended after compression and not yet quantised "
                f"({self.exact_tail_length}); asked for crop({tokens_to_remove})"
            )
        self.tail_length += tokens_to_remove
        self.tokens_seen += tokens_to_remove


def native_layer(sliding_window: int | None) -> CacheLayerMixin:
    """A fresh transformers layer of the kind a compressed layer replaced."""
    if sliding_window is not None:
        return DynamicSlidingWindowLayer(sliding_window=sliding_window)
    return DynamicLayer()


# ---------------------------------------------------------------- reports
@dataclass(frozen=True)
class LayerReport:
    """What one cache layer holds. ``stored`` counts exact tokens per KV head (mean over rows and
    heads), ``residual`` summary entries, ``extra_slots`` the token-slot equivalents of other state a
    method keeps per row and KV head (``OutputCorrection``); ``compressed`` is False when the layer
    kept everything.
    ``storage`` says how the entries are held (``exact``, ``kivi 4-bit``, ``keys 38/64 channels``...),
    and ``nbytes`` what that costs (packed codes, scales, zero-points, outliers and exact tail)."""

    layer: int
    kind: str
    tokens_seen: int
    stored_min: int
    stored_max: int
    stored_mean: float
    residual: float
    nbytes: int
    extra_slots: float = 0.0
    #: token slots (of ``2 d`` numbers) per KV head that query-dependent value terms hold (MomentKV's covariance)
    statistics: float = 0.0
    storage: str = "exact"

    @property
    def compressed(self) -> bool:
        return self.kind == "compressed" and self.stored_max + self.residual < self.tokens_seen


def cache_report(cache: Cache) -> list[LayerReport]:
    """Per-layer tokens seen vs stored, so a run in which nothing was compressed is visible."""
    reports = []
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, CompressedLayer):
            stored = layer.kept_counts + layer.tail_length
            reports.append(
                LayerReport(
                    index, "compressed", layer.tokens_seen, int(stored.min()), int(stored.max()),
                    float(stored.float().mean()), float(layer.residual_counts.float().mean()), layer.nbytes(),
                    layer.output_correction.token_slots() if layer.output_correction is not None else 0.0,
                    layer.statistics_slots(),
                    layer.storage,
                )
            )
        else:
            seen = layer.get_seq_length() if layer.is_initialized else 0
            held = layer.keys.shape[-2] if layer.is_initialized and layer.keys is not None and layer.keys.dim() == 4 else 0
            nbytes = 0
            if held:
                nbytes = sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
            reports.append(LayerReport(index, "native", seen, held, held, float(held), 0.0, nbytes))
    return reports


@dataclass(frozen=True)
class KeptPositions:
    """What one cache layer keeps, as row-local positions (0 = a row's first real token).

    exact: ``[B][H_kv]`` sorted positions of the exact tokens held (kept prompt tokens and tokens
    appended later). summaries: ``[B][H_kv]`` how many summary entries (ResKV's residual entries,
    MomentKV's entry) the head holds beside them; they stand for evicted tokens and have no
    single position.
    """

    exact: list[list[list[int]]]
    summaries: list[list[int]]


def kept_positions(cache: Cache) -> list[KeptPositions]:
    """Per layer, the positions each row and KV head keeps (``KeptPositions``): what parity
    tests compare with another library's kept sets. A native layer (nothing evicted) lists
    every column it holds: it does not know a row's left padding, so read it on unpadded rows."""
    result = []
    for layer in cache.layers:
        if isinstance(layer, CompressedLayer):
            columns = layer.kept_columns
            padding = layer.prompt_padding.to(columns.device)[:, None, None]
            positions = torch.where(columns >= 0, columns - padding, -1)
            tail_start = layer.tokens_seen - layer.tail_length
            tail = torch.arange(tail_start, layer.tokens_seen, device=columns.device)
            summaries = layer.residual_counts.tolist()
            exact = [[sorted(head[head >= 0].tolist() + (tail - int(padding[row])).tolist())
                      for head in positions[row]] for row in range(positions.shape[0])]
        else:
            keys = layer.keys if layer.is_initialized else None
            held = keys.shape[-2] if keys is not None and keys.dim() == 4 else 0
            batch, heads = (keys.shape[0], keys.shape[1]) if held else (0, 0)
            exact = [[list(range(held)) for _ in range(heads)] for _ in range(batch)]
            summaries = [[0] * heads for _ in range(batch)]
        result.append(KeptPositions(exact, summaries))
    return result


def cache_nbytes(cache: Cache) -> int:
    """Bytes held by every layer of ``cache``."""
    return sum(report.nbytes for report in cache_report(cache))


def format_report(reports: list[LayerReport]) -> str:
    """A plain-text table of ``cache_report``."""
    lines = [f"{'layer':>5} {'kind':>10} {'seen':>7} {'stored(min/mean/max)':>22} {'residual':>8} {'extra':>6} "
             f"{'stats':>6} {'MiB':>8}  storage"]
    for r in reports:
        stored = f"{r.stored_min}/{r.stored_mean:.1f}/{r.stored_max}"
        lines.append(f"{r.layer:>5} {r.kind:>10} {r.tokens_seen:>7} {stored:>22} {r.residual:>8.1f} "
                     f"{r.extra_slots:>6.1f} {r.statistics:>6.1f} {r.nbytes / 2**20:>8.3f}  {r.storage}")
    compressed = sum(r.compressed for r in reports)
    lines.append(f"{compressed} of {len(reports)} layers hold fewer entries than tokens seen")
    return "\n".join(lines)
