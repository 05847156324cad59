"""Quantised storage of the compressed cache (``--quant_method kivi|kvquant``).

The codes, the segment that holds kept tokens as codes (``QuantizedTokens``), and the two parts that
choose them (``restkv.quantizers``):

* ``kivi`` (Liu et al., 2024, arXiv 2402.02750): asymmetric uniform integers of ``--nbits``
  bits with a scale and a zero-point (the group's minimum) per group; keys are quantised
  **per channel** (a group is ``--quant_group_size`` consecutive tokens of one channel, so
  the outlier channels of keys get their own ranges), values **per token** (a group is
  ``--quant_group_size`` consecutive channels of one token). Codes are packed into uint8
  (four 2-bit, two 4-bit or one 8-bit code per byte) along the channel axis.
* ``kvquant``: KVQuant's dense-and-sparse split (Hooper et al., 2024, arXiv 2401.18079) on the
  same codes. In each vector (a key channel over the tokens quantised together, a value token
  over its channels) the elements at or beyond its ``1 - f/2`` and ``f/2`` quantiles
  (``--quant_outlier_fraction`` f, default 1%; upper and lower apart, as KVQuant's
  ``sparsity_threshold``) are kept exactly in a sparse side store (flat int32/int64 index and
  value) and left out of their group's range. KVQuant computes value thresholds per token online,
  as here, and key thresholds per channel offline on calibration data (here online, over the
  block). ``--quant_outlier_threshold T`` uses the original release's fixed ``|x| > T`` (it ran
  6) instead: on SmolLM2 (1024 tokens) that keeps 2.0% of key entries but 0.08% of value entries,
  where the percentiles keep 1.2% and 3.1% (a 64-channel token's largest and smallest). The first
  ``--quant_exact_sinks`` prompt tokens (default 5, KVQuant's attention-sink-aware
  ``--first_few_fp16``) are kept whole in the side store when the storage passes their slots
  (``KIVI.exact_sink_slots``). Not implemented: keys quantised before RoPE (the cache holds
  post-RoPE keys), non-uniform sensitivity-weighted levels (``nuq``), Q-Norm (rescaling those
  levels to each vector's mean and spread), a cap on outliers per token, and KVQuant's ranges
  (one per key channel, calibrated, and one per value token, with no groups): KIVI's groups of
  ``--quant_group_size`` stay.

A quantise-dequantise round trip is off by at most half a step (``scale / 2``, the stored
scale) per element in every dtype, plus the rounding of the dequantised value to the
tensor's dtype (half its spacing there: at most 2^-8 of the value in bfloat16, 2^-11 in float16;
in bfloat16 at 8 bits the two terms are of a size, the codes being as fine as its mantissa),
outliers restored exactly. Scales and zero-points are stored in the tensor's own dtype, as
KIVI's kernels keep them (KIVI computes minimum, maximum, scale and codes in float16 and stores
scale and minimum in float16, so its rounded scale can leave the top code short of the maximum).
Here they are computed in float32, the scale is rounded *up* to the dtype (so the top code
reaches the group's maximum: a scale rounded down cost up to one whole step in bfloat16 at
8 bits, and float16 scales below its subnormals rounded to zero), and the codes come from
the stored scale.

Where it is used: ``QuantizedTokens`` is the segment of a compressed layer (``restkv.cache``)
that holds kept tokens this way, quantised once after eviction, except each head's newest
``--quant_residual_length`` (R) kept tokens, which stay exact as KIVI's residual does. While
decoding the layer keeps at least its newest R tokens exact: once 2R are, the oldest R become
a ``QuantizedTokens`` segment of their own. KIVI keeps exactly R values and the last L mod R
keys exact (values are quantised one token at a time); here keys and values share the window,
so between R and 2R - 1 of each are exact, counted in ``cache_report``. A read dequantises ``READ_BLOCK`` slots at
a time into a workspace every layer shares (``restkv.cache.partial.workspace``), so no
full-precision copy of a quantised layer persists between steps."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from restkv.cache.partial import Partial, Probe, attend_block, merge, workspace
from restkv.cache.segments.base import SegmentReport, tensor_bytes

#: bit widths the packing supports, and how many codes each byte holds
CODES_PER_BYTE = {2: 4, 4: 2, 8: 1}


#: slots a quantised segment dequantises at once when attention reads it (rounded to whole key groups)
READ_BLOCK = 1024


def pack(codes: torch.Tensor, nbits: int) -> torch.Tensor:
    """uint8 codes ``[..., n]`` (each below ``2**nbits``) packed along the last axis into
    ``[..., ceil(n * nbits / 8)]`` uint8 (the first code in the lowest bits)."""
    per_byte = CODES_PER_BYTE[nbits]
    if per_byte == 1:
        return codes.to(torch.uint8)
    grow = -codes.shape[-1] % per_byte
    codes = torch.nn.functional.pad(codes.to(torch.uint8), (0, grow)).view(*codes.shape[:-1], -1, per_byte)
    shifts = torch.arange(0, 8, nbits, dtype=torch.uint8, device=codes.device)
    return (codes << shifts).sum(dim=-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, nbits: int, count: int) -> torch.Tensor:
    """The first ``count`` codes of each row of ``pack``'s output, as uint8 ``[..., count]``."""
    if CODES_PER_BYTE[nbits] == 1:
        return packed[..., :count]
    shifts = torch.arange(0, 8, nbits, dtype=torch.uint8, device=packed.device)
    codes = (packed[..., None] >> shifts) & ((1 << nbits) - 1)
    return codes.flatten(-2)[..., :count]


_CODE_TABLES: dict[tuple[int, str], torch.Tensor] = {}


def unpack_float(packed: torch.Tensor, nbits: int, count: int) -> torch.Tensor:
    """``unpack``'s codes as float32, through a table of every byte's codes (one lookup per byte instead of a
    shift, a mask and a conversion per code: what a decode step's dequantisation runs)."""
    key = (nbits, str(packed.device))
    if key not in _CODE_TABLES:
        _CODE_TABLES[key] = unpack(torch.arange(256, dtype=torch.uint8, device=packed.device)[:, None], nbits,
                                   CODES_PER_BYTE[nbits]).float()
    codes = _CODE_TABLES[key].index_select(0, packed.reshape(-1).long())
    return codes.view(*packed.shape[:-1], -1)[..., :count]


@dataclass
class QuantizedTensor:
    """A ``[..., S, d]`` tensor as packed codes with a scale and a zero-point per group.

    packed: uint8 ``[..., S, ceil(d * nbits / 8)]``.
    scale, zero: ``[..., ceil(S / g), d]`` (``per_channel``: groups of ``g`` tokens of one
        channel) or ``[..., S, ceil(d / g)]`` (per token: groups of ``g`` channels of one token).
    outlier_index, outlier_value: the exact side store (flat indices into the tensor, and its
        values), or None.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    nbits: int
    group: int
    per_channel: bool
    channels: int
    outlier_index: torch.Tensor | None = None
    outlier_value: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.channels)

    @property
    def dtype(self) -> torch.dtype:
        return self.scale.dtype

    def dequantize(self, start: int = 0, stop: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens ``start:stop`` (along ``S``; ``start`` a multiple of the group for per-channel
        codes) in the stored dtype, outliers restored exactly; written into ``out`` (a reused
        buffer of that shape) when given."""
        stop = self.packed.shape[-2] if stop is None else stop
        codes = unpack_float(self.packed[..., start:stop, :], self.nbits, self.channels)
        block = self._scaled(codes, start, stop, out)
        if self.outlier_index is not None and self.outlier_index.numel():
            rows = self.packed.shape[-2]
            token = (self.outlier_index // self.channels) % rows
            inside = (token >= start) & (token < stop)
            index = self.outlier_index[inside].long()
            local = (index // (rows * self.channels)) * ((stop - start) * self.channels) + \
                (token[inside].long() - start) * self.channels + index % self.channels
            block.view(-1)[local] = self.outlier_value[inside]
        return block

    def _scaled(self, codes: torch.Tensor, start: int, stop: int, out: torch.Tensor | None) -> torch.Tensor:
        """``zero + codes * scale`` of tokens ``start:stop`` (codes float32 ``[..., n, d]``), each group's
        statistics broadcast over its members (a copy of them only for a partial group), in the
        stored dtype; into ``out`` when given."""
        count, group = stop - start, self.group
        if self.per_channel and out is not None and count > group and count % group:
            whole = count // group * group  # the whole groups, then the last one on its own: nothing is spread
            self._scaled(codes[..., :whole, :], start, start + whole, out[..., :whole, :])
            self._scaled(codes[..., whole:, :], start + whole, stop, out[..., whole:, :])
            return out
        if self.per_channel:
            groups = slice(start // group, -(-stop // group))
            scale, zero = self.scale[..., groups, :], self.zero[..., groups, :]
            if not count % group:  # [..., n / g, g, d] codes against [..., n / g, 1, d] statistics
                codes, scale, zero = codes.unflatten(-2, (-1, group)), scale[..., None, :], zero[..., None, :]
            elif count > group:
                scale, zero = (_spread(t, group, -2, count) for t in (scale, zero))
            # else within one group: its [..., 1, d] statistics broadcast over the tokens
        else:
            scale, zero = self.scale[..., start:stop, :], self.zero[..., start:stop, :]
            if self.channels % group:
                scale, zero = (_spread(t, group, -1, self.channels) for t in (scale, zero))
            else:  # [..., n, d / g, g] codes against [..., n, d / g, 1] statistics
                codes, scale, zero = codes.unflatten(-1, (-1, group)), scale[..., None], zero[..., None]
        shape = (*self.packed.shape[:-2], count, self.channels)
        if out is not None and out.dtype == torch.float32 and scale.dtype == torch.float32:
            return torch.addcmul(zero, codes, scale, out=out.view(codes.shape)).view(shape)
        block = torch.addcmul(zero.float(), codes, scale.float()).reshape(shape)
        return block.to(self.dtype) if out is None else out.copy_(block)

    def tensors(self) -> list[torch.Tensor]:
        """What the tensor holds (for the memory report)."""
        side = [self.outlier_index, self.outlier_value] if self.outlier_index is not None else []
        return [self.packed, self.scale, self.zero, *side]

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "QuantizedTensor":
        """The same tensor with ``fn`` (a batch reorder, repeat or selection) applied to its rows."""
        mapped = QuantizedTensor(fn(self.packed), fn(self.scale), fn(self.zero), self.nbits, self.group,
                                 self.per_channel, self.channels)
        if self.outlier_index is not None:
            rows = self.packed.shape[0]
            per_row = self.packed[0].numel() // self.packed.shape[-1] * self.channels if rows else 0
            source = fn(torch.arange(rows, device=self.packed.device))  # the old row of each new row
            match = (self.outlier_index.long() // per_row)[None, :] == source[:, None]
            new_row, which = match.nonzero(as_tuple=True)
            index = new_row * per_row + self.outlier_index[which].long() % per_row
            mapped.outlier_index, mapped.outlier_value = index.to(self.outlier_index.dtype), self.outlier_value[which]
        return mapped


def _rounded_up(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``scale`` in ``dtype``, never below it: the top code then reaches the group's
    maximum, so no element is clamped by more than half a step (a scale rounded down, or to
    zero below float16's subnormals, would clamp the group's largest elements)."""
    stored = scale.to(dtype)
    return torch.where(stored.float() < scale, torch.nextafter(stored, torch.full_like(stored, math.inf)), stored)


def _spread(groups: torch.Tensor, size: int, dim: int, length: int) -> torch.Tensor:
    """Per-group statistics repeated over their members along ``dim``, cut to ``length``."""
    return groups.repeat_interleave(size, dim=dim).narrow(dim, 0, length)


def quantize(x: torch.Tensor, nbits: int, group: int, per_channel: bool, valid: torch.Tensor | None = None,
             outliers: torch.Tensor | None = None) -> QuantizedTensor:
    """Asymmetric ``nbits`` codes of ``x`` ``[..., S, d]`` in groups of ``group`` tokens per
    channel (``per_channel``) or ``group`` channels per token.

    valid: optional bool ``[..., S]``, the slots that hold entries (unused slots of a padded
    layer do not widen a group's range). outliers: optional bool ``[..., S, d]``, elements kept
    exactly in the side store (KVQuant's outliers, whole sink tokens) and left out of their
    group's range.
    """
    if nbits not in CODES_PER_BYTE:
        raise ValueError(f"nbits must be one of {sorted(CODES_PER_BYTE)}; got {nbits}")
    tokens, channels = x.shape[-2:]
    member = torch.ones_like(x, dtype=torch.bool) if valid is None else valid[..., None].expand_as(x).clone()
    if outliers is not None:
        outliers = member & outliers
        member &= ~outliers
    dim, length = (-2, tokens) if per_channel else (-1, channels)
    grow = -length % group
    pad = (0, 0, 0, grow) if per_channel else (0, grow)
    grouped_x = torch.nn.functional.pad(x.float(), pad)
    grouped_member = torch.nn.functional.pad(member, pad, value=False)
    if per_channel:
        shape = (*x.shape[:-2], -1, group, channels)
        grouped_x, grouped_member, reduce = grouped_x.view(shape), grouped_member.view(shape), -2
    else:
        shape = (*x.shape[:-1], -1, group)
        grouped_x, grouped_member, reduce = grouped_x.view(shape), grouped_member.view(shape), -1
    low = grouped_x.masked_fill(~grouped_member, float("inf")).amin(dim=reduce)
    high = grouped_x.masked_fill(~grouped_member, float("-inf")).amax(dim=reduce)
    empty = ~grouped_member.any(dim=reduce)
    low, high = low.masked_fill(empty, 0.0), high.masked_fill(empty, 0.0)
    top = (1 << nbits) - 1
    zero = low.to(x.dtype)
    scale = _rounded_up((high - zero.float()) / top, x.dtype)
    step = _spread(scale, group, dim, length).float()
    offset = _spread(zero, group, dim, length).float()
    codes = torch.round((x.float() - offset) / torch.where(step > 0, step, 1.0)).clamp(0, top).to(torch.uint8)
    quantized = QuantizedTensor(pack(codes, nbits), scale, zero, nbits, group, per_channel, channels)
    if outliers is not None:
        index = outliers.flatten().nonzero().squeeze(-1)
        quantized.outlier_index = index.to(torch.int32 if x.numel() < 2**31 else torch.int64)
        quantized.outlier_value = x.flatten()[index]
    return quantized


# ---------------------------------------------------------------- the segment
class QuantizedTokens:
    """Exact-token slots held as packed codes (``--quant_method``): keys per channel, values per
    token, codes of every slot and the ranges of the slots that hold a token.

    keys, values: ``[B, H_kv, S, d]`` the tokens (a padded view); columns: ``[B, H_kv, S]`` their
    padded-batch columns (-1 = unused slot, quantised too: head-adaptive budgets pay
    ``nbits / 16`` of a 16-bit slot for each); quantizer: the ``KIVI``/``KVQuant`` part; padding:
    ``[B]`` each row's left padding, given for prompt tokens, whose first ``exact_sinks`` stay exact
    in the side store (appended blocks hold none).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor, quantizer,
                 padding: torch.Tensor | None = None) -> None:
        held = columns >= 0
        self.quantizer = quantizer
        exact = None if padding is None else quantizer.exact_sink_slots(columns, padding)
        self.keys = quantizer.quantize_keys(keys, held, exact)
        self.values = quantizer.quantize_values(values, held, exact)
        self.columns = columns.to(torch.int32)
        self.holes = not bool(held.all())

    @property
    def kind(self) -> str:
        return f"{self.quantizer.name} {self.quantizer.nbits}-bit"

    storage = kind

    @classmethod
    def _of(cls, keys: QuantizedTensor, values: QuantizedTensor, columns: torch.Tensor, quantizer) -> "QuantizedTokens":
        segment = cls.__new__(cls)
        segment.keys, segment.values, segment.columns, segment.quantizer = keys, values, columns, quantizer
        segment.holes = not bool((columns >= 0).all())
        return segment

    def blocks(self) -> list[tuple[int, int]]:
        """The ``(start, stop)`` slot ranges read at once: ``READ_BLOCK`` slots in whole key groups."""
        group = self.keys.group
        size = max(group, READ_BLOCK // group * group)
        width = self.columns.shape[-1]
        return [(start, min(start + size, width)) for start in range(0, width, size)]

    def attend(self, probe: Probe) -> Partial:
        """Each block dequantised into the shared workspace, read, and the partials merged."""
        parts = []
        batch, heads = self.columns.shape[:2]
        for start, stop in self.blocks():
            keys = workspace("keys", (batch, heads, stop - start, self.keys.channels), self.keys.dtype,
                             self.columns.device)
            values = workspace("values", (batch, heads, stop - start, self.values.channels), self.values.dtype,
                               self.columns.device)
            self.keys.dequantize(start, stop, out=keys)
            self.values.dequantize(start, stop, out=values)
            columns = self.columns[..., start:stop]
            visible = probe.visibility(columns) if self.holes or probe.masks_by_position else None
            parts.append(attend_block(probe, keys, values, visible))
        return merge(parts)

    @property
    def slot_count(self) -> int:
        return self.columns.shape[-1]

    def write_slots(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Dequantise every slot straight into a shared buffer (``restkv.cache.segments.base.SlotWriter``): the
        codes are read once a step and no copy of them outlives the read."""
        for quantized, out in ((self.keys, keys), (self.values, values)):
            if quantized.outlier_index is None:
                quantized.dequantize(out=out)
            else:  # outliers are restored through a flat view, which a strided slice of the buffer has not
                out.copy_(quantized.dequantize())
        return self.columns

    def padded(self, appended: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, values, columns)``, dequantised (a temporary copy, for compression and inspection)."""
        held = (self.columns >= 0)[..., None]
        return (self.keys.dequantize().masked_fill(~held, 0), self.values.dequantize().masked_fill(~held, 0),
                self.columns)

    def kept_counts(self) -> torch.Tensor:
        return (self.columns >= 0).sum(dim=-1)

    held_counts = kept_counts

    def report(self) -> SegmentReport:
        tokens = self.held_counts()
        return SegmentReport(self.kind, tokens, float(tokens.float().mean()) if tokens.numel() else 0.0,
                             self.nbytes())

    def tensors(self) -> list[torch.Tensor]:
        return [*self.keys.tensors(), *self.values.tensors(), self.columns]

    def nbytes(self) -> int:
        return tensor_bytes(self.tensors())

    def fork(self) -> "QuantizedTokens":
        return self  # never written after it is built

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "QuantizedTokens":
        """The codes of the mapped rows (nothing is quantised again)."""
        return QuantizedTokens._of(self.keys.map_batch(fn), self.values.map_batch(fn), fn(self.columns),
                                   self.quantizer)
