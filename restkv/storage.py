"""Exact tokens of a compressed layer: the segments that hold kept and appended tokens whole.

Every KV head of every row holds a *sequence*: the tokens it kept at its last compression
(ascending positions), then the tokens appended since (a question chunk, generated tokens),
then spare capacity, so a decode step writes its token in place and rarely reallocates
(``spare_slots``: an eighth of what the sequence holds, or the generation's length when the
caller knows it, ``reserve``; it grows by the same share when it runs out). Each token carries its padded-batch column
(``-1``: an unused slot, or an appended padding token), which is all a probe needs to say who
sees it (``restkv.partial.Probe.visibility``). Two layouts:

* ``DenseTokens``: one ``[B, H_kv, W, d]`` buffer, every head's sequence at the same slots (heads
  that keep fewer tokens leave holes, marked by their columns). A step reads one contiguous
  block: ``[:, :, :used]``, one fused kernel call, no mask when there is no hole.
* ``RaggedTokens``: each (row, KV head)'s sequence back to back in one ``[N, d]`` buffer, so
  head-adaptive budgets (AdaKV, HeadKV, LaProx, KVzip) hold what they allocate. A step reads
  each sequence where it lies (one kernel call per row and KV head; nothing is re-padded).

``exact_tokens`` picks the ragged layout when the dense one would waste more than
``RAGGED_WASTE`` of its kept slots. Both report their kind, tokens, token-slot equivalents and
bytes (``SegmentReport``): the bytes their buffers hold (spare capacity included), and the bytes
of the slots in use (kept and appended tokens, their int32 columns).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from restkv.partial import Partial, Probe, attend_block, softmax_partial

#: the share of padded kept slots above which a layer is stored ragged
RAGGED_WASTE = 0.02
#: spare capacity for appended tokens, as a share of what a sequence holds (and its least)
SPARE_SHARE, MIN_SPARE = 0.125, 4


def spare_slots(held: int) -> int:
    """The appended-token room a sequence holding ``held`` tokens gets when it is built or grows:
    ``SPARE_SHARE`` of them, so memory follows the budget (at least ``MIN_SPARE``); a grown
    buffer is then ``1 + SPARE_SHARE`` times its tokens, and growing stays amortised."""
    return max(MIN_SPARE, math.ceil(SPARE_SHARE * held))


@dataclass(frozen=True)
class SegmentReport:
    """What one segment holds.

    kind: ``exact dense``, ``exact ragged``, ``kivi 4-bit``, ``keys 38/64 channels``, ``reskv entries``...
    tokens: ``[B, H_kv]`` exact tokens it holds (None for summaries: they stand for evicted tokens).
    slots: token-slot equivalents per row and KV head (mean), a slot being one key and one value
        of the model dtype: what the segment takes from the budget.
    nbytes: bytes its tensors hold (allocated, spare capacity included).
    used_nbytes: bytes of what it stores (its tensors at their used length); ``nbytes`` when it has
        no spare capacity.
    """

    kind: str
    tokens: torch.Tensor | None
    slots: float
    nbytes: int
    used_nbytes: int | None = None

    def __post_init__(self) -> None:
        if self.used_nbytes is None:
            object.__setattr__(self, "used_nbytes", self.nbytes)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def write_columns(target: torch.Tensor, first: int, count: int, columns: torch.Tensor | None) -> bool:
    """Write the columns of ``count`` appended tokens into ``target`` (``[B, H_kv, q]``, a view of a
    segment's columns): ``columns`` ``[B, q]`` (-1 = padding), or ``first, first + 1, ...`` when
    None. Returns whether a padding token came with them."""
    if columns is None:
        if count == 1:
            target.fill_(first)
        else:
            target.copy_(torch.arange(first, first + count, dtype=torch.int32, device=target.device))
        return False
    target.copy_(columns.to(torch.int32)[:, None, :])
    return bool((columns < 0).any())


class ExactTokens:
    """What both layouts share: the kept/appended bookkeeping and copy-on-write between forks."""

    kind: str
    storage = "exact"
    #: tokens appended since the last compression (the same for every sequence)
    appended: int
    _shared: bool

    def append_tokens(self, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor) -> None:
        """Append tokens another segment held, ``[B, H_kv, q, d]`` with their columns ``[B, H_kv, q]``
        (the same for every head: appended tokens are)."""
        self.append(keys, values, 0, columns[:, 0])

    def fork(self) -> "ExactTokens":
        """A copy that shares the buffers until either side writes (``answer_many``'s snapshots)."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        self._shared = twin._shared = True
        return twin

    def _own(self) -> None:
        """Copy the buffers before the first write after a fork."""
        if self._shared:
            self._clone_buffers()
            self._shared = False

    @property
    def rows(self) -> int:
        """The batch size ``B``."""
        return self.columns.shape[0] if self.columns.dim() == 3 else self.shape[0]

    @property
    def kv_heads(self) -> int:
        """The KV heads ``H_kv``."""
        return self.columns.shape[1] if self.columns.dim() == 3 else self.shape[1]

    def report(self) -> SegmentReport:
        tokens = self.held_counts()
        return SegmentReport(self.kind, tokens, float(tokens.float().mean()) if tokens.numel() else 0.0,
                             self.nbytes(), self.used_nbytes())


class DenseTokens(ExactTokens):
    """Every head's sequence at the same slots of one ``[B, H_kv, W, d]`` buffer (see the module docstring).

    keys, values: ``[B, H_kv, K, d]`` kept tokens (keys may hold fewer channels than values:
    ThinK); columns: ``[B, H_kv, K]`` their padded-batch columns (-1 = unused slot);
    capacity: appended tokens the buffer holds before it grows (default ``spare_slots(K)``; 0 for a
    segment that never appends).
    """

    kind = "exact dense"

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor,
                 capacity: int | None = None) -> None:
        batch, heads, kept, _ = keys.shape
        width = kept + (spare_slots(kept) if capacity is None else capacity)
        self.keys = keys.new_empty(batch, heads, width, keys.shape[-1])
        self.values = values.new_empty(batch, heads, width, values.shape[-1])
        self.columns = torch.full((batch, heads, width), -1, dtype=torch.int32, device=keys.device)
        self.keys[:, :, :kept], self.values[:, :, :kept] = keys, values
        self.columns[:, :, :kept] = columns
        self.kept_width, self.appended = kept, 0
        self.holes = bool((columns < 0).any())
        self._shared = False

    @classmethod
    def empty(cls, like: torch.Tensor, key_dim: int | None = None, capacity: int | None = None) -> "DenseTokens":
        """A segment with no kept token (the tail of a layer whose kept tokens are stored otherwise)."""
        batch, heads = like.shape[:2]
        keys = like.new_zeros(batch, heads, 0, key_dim or like.shape[-1])
        values = like.new_zeros(batch, heads, 0, like.shape[-1])
        return cls(keys, values, torch.zeros(batch, heads, 0, dtype=torch.int32, device=like.device), capacity)

    @property
    def used(self) -> int:
        return self.kept_width + self.appended

    @property
    def value_dim(self) -> int:
        return self.values.shape[-1]

    def _clone_buffers(self) -> None:
        self.keys, self.values, self.columns = self.keys.clone(), self.values.clone(), self.columns.clone()

    # ------------------------------------------------------------ contents
    def kept_counts(self) -> torch.Tensor:
        return (self.columns[:, :, : self.kept_width] >= 0).sum(dim=-1)

    def held_counts(self) -> torch.Tensor:
        """``[B, H_kv]`` exact tokens held (kept and appended real ones)."""
        return (self.columns[:, :, : self.used] >= 0).sum(dim=-1)

    def padded(self, appended: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, values, columns)`` ``[B, H_kv, S, d]``: the kept tokens, then (``appended``) the
        appended ones; holes have column -1. Views of the buffer (no copy)."""
        stop = self.used if appended else self.kept_width
        return self.keys[:, :, :stop], self.values[:, :, :stop], self.columns[:, :, :stop]

    def appended_tokens(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, values, columns)`` of the appended tokens, ``[B, H_kv, T, d]`` (views)."""
        window = slice(self.kept_width, self.used)
        return self.keys[:, :, window], self.values[:, :, window], self.columns[:, :, window]

    # ------------------------------------------------------------ writing
    def append(self, keys: torch.Tensor, values: torch.Tensor, first: int, columns: torch.Tensor | None = None) -> None:
        """Write ``[B, H_kv, q, d]`` new tokens after the sequence, at padded-batch columns ``first ..``
        (``columns`` ``[B, q]`` when some are padding: -1), growing the buffer (doubling) only
        when it is full."""
        self._own()
        new = keys.shape[2]
        if self.used + new > self.keys.shape[2]:
            self._grow(self.used + new + spare_slots(self.used + new))
        window = slice(self.used, self.used + new)
        self.keys[:, :, window], self.values[:, :, window] = keys, values
        self.holes = write_columns(self.columns[:, :, window], first, new, columns) or self.holes
        self.appended += new

    def reserve(self, appends: int) -> None:
        """Make room for ``appends`` more appended tokens at once (a generation of known length)."""
        if self.used + appends > self.keys.shape[2]:
            self._grow(self.used + appends)
            self._shared = False  # the grown buffers are this segment's own

    def _grow(self, width: int) -> None:
        used = self.used
        for name in ("keys", "values", "columns"):
            old = getattr(self, name)
            grown = old.new_full((*old.shape[:2], width, *old.shape[3:]), -1) if name == "columns" else \
                old.new_empty((*old.shape[:2], width, *old.shape[3:]))
            grown[:, :, :used] = old[:, :, :used]
            setattr(self, name, grown)

    def drop_appended(self, oldest: int = 0, newest: int = 0) -> None:
        """Forget the ``oldest`` and the ``newest`` appended tokens (a sliding window's past, a
        quantised block, a crop); the rest move up to follow the kept tokens."""
        self._own()
        start, stop = self.kept_width + oldest, self.used - newest
        keep = stop - start
        for tensor in (self.keys, self.values, self.columns):
            tensor[:, :, self.kept_width : self.kept_width + keep] = tensor[:, :, start:stop].clone()
        self.columns[:, :, self.kept_width + keep : self.used] = -1
        self.appended = keep

    def drop_oldest(self, count: int) -> int:
        """Forget the ``count`` oldest slots, kept ones first (a quantiser sealing the oldest block of
        its exact window); the rest move up. Returns how many of them were appended tokens."""
        self._own()
        keep = self.used - count
        for tensor in (self.keys, self.values, self.columns):
            tensor[:, :, :keep] = tensor[:, :, count : self.used].clone()
        self.columns[:, :, keep : self.used] = -1
        from_kept = min(count, self.kept_width)
        self.kept_width -= from_kept
        self.appended -= count - from_kept
        self.holes = bool((self.columns[:, :, :keep] < 0).any())
        return count - from_kept

    # ------------------------------------------------------------ reading
    def attend(self, probe: Probe) -> Partial:
        """One kernel call over the used slots (a mask only for holes, several queries or a window)."""
        keys, values, columns = self.padded()
        if probe.value_heads is not None:  # every head holds the same tokens: another head's values are theirs
            values = values.index_select(1, probe.value_heads)
        visible = probe.visibility(columns) if self.holes or probe.masks_by_position else None
        return attend_block(probe, keys, values, visible)

    # ------------------------------------------------------------ bookkeeping
    def nbytes(self) -> int:
        return tensor_bytes([self.keys, self.values, self.columns])

    def used_nbytes(self) -> int:
        return tensor_bytes(self.padded())

    def tensors(self) -> list[torch.Tensor]:
        return list(self.padded())

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "DenseTokens":
        """The segment with ``fn`` (a batch reorder, repeat or selection) applied to its rows."""
        keys, values, columns = (fn(t) for t in self.padded(appended=False))
        mapped = DenseTokens(keys, values, columns, self.keys.shape[2] - self.kept_width)
        if self.appended:
            mapped.append_tokens(*(fn(t) for t in self.appended_tokens()))
        return mapped


class RaggedTokens(ExactTokens):
    """Each (row, KV head)'s sequence back to back in one ``[N, d]`` buffer (see the module docstring).

    Built from a padded view (``keys``, ``values`` ``[B, H_kv, S, d]``, ``columns`` ``[B, H_kv, S]``,
    -1 = unused slot): sequence ``i = b * H_kv + h`` holds its real tokens in slot order at
    ``starts[i] ..``, then room for ``capacity`` appended tokens (default ``spare_slots`` of the mean
    sequence).
    """

    kind = "exact ragged"

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor,
                 capacity: int | None = None) -> None:
        batch, heads = keys.shape[:2]
        held = columns >= 0
        self.shape = (batch, heads)
        self.kept = held.sum(dim=-1).flatten().to(torch.int32)  # [B * H_kv]
        if capacity is None:
            capacity = spare_slots(int(self.kept.sum()) // max(self.kept.numel(), 1))
        self.appended, self.capacity = 0, capacity
        self.starts = _starts(self.kept, capacity)
        total = int((self.kept + capacity).sum())
        self.keys = keys.new_zeros(total, keys.shape[-1])
        self.values = values.new_zeros(total, values.shape[-1])
        self.columns = torch.full((total,), -1, dtype=torch.int32, device=keys.device)
        slot = self._slots(self.kept)
        self.keys[slot], self.values[slot], self.columns[slot] = keys[held], values[held], columns[held].to(torch.int32)
        self.holes = False
        self._lengths = self.kept.tolist()
        self._index_sequences()
        self._shared = False

    def _index_sequences(self) -> None:
        """Where each sequence starts (a list, for the per-head reads), where its appended tokens
        start, and which sequence owns each slot of the buffer."""
        self._start_list = self.starts.tolist()
        self._tail_starts = (self.starts + self.kept).long()
        lengths = (self.kept + self.capacity).long()
        self._owner = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
        self._own_slot_masks: dict[int, torch.Tensor] = {}

    def _slots(self, lengths: torch.Tensor) -> torch.Tensor:
        """Flat buffer index of the first ``lengths[i]`` slots of every sequence ``i``, in order."""
        sequence = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
        offset = torch.arange(sequence.numel(), device=lengths.device) - (torch.cumsum(lengths, 0) - lengths)[sequence]
        return self.starts[sequence] + offset

    @property
    def value_dim(self) -> int:
        return self.values.shape[-1]

    def _clone_buffers(self) -> None:
        self.keys, self.values, self.columns = self.keys.clone(), self.values.clone(), self.columns.clone()

    # ------------------------------------------------------------ contents
    def kept_counts(self) -> torch.Tensor:
        return self.kept.long().view(self.shape)

    def held_counts(self) -> torch.Tensor:
        extra = torch.zeros_like(self.kept, dtype=torch.long)
        if self.appended:
            extra = (self._appended_columns() >= 0).sum(dim=-1)
        return (self.kept + extra).view(self.shape)

    def _appended_slots(self, start: int = 0, count: int | None = None) -> torch.Tensor:
        """``[B * H_kv, count]`` flat buffer index of appended tokens ``start .. start + count``
        (default: every one)."""
        count = self.appended - start if count is None else count
        return self._tail_starts[:, None] + torch.arange(start, start + count, device=self._tail_starts.device)

    def _appended_columns(self) -> torch.Tensor:
        return self.columns[self._appended_slots()]

    def padded(self, appended: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The padded view: each head's kept tokens, then (``appended``) its appended ones, then
        holes (column -1). Rebuilt: for compression and inspection, never for a decode step."""
        batch, heads = self.shape
        lengths = self.kept + (self.appended if appended else 0)
        width = int(lengths.max()) if lengths.numel() else 0
        slot = torch.arange(width, device=lengths.device)
        inside = slot[None, :] < lengths[:, None]
        index = torch.where(inside, self.starts[:, None] + slot[None, :], 0)
        keys = self.keys[index].masked_fill(~inside[..., None], 0)
        values = self.values[index].masked_fill(~inside[..., None], 0)
        columns = self.columns[index].masked_fill(~inside, -1)
        return (keys.view(batch, heads, width, -1), values.view(batch, heads, width, -1),
                columns.view(batch, heads, width))

    def appended_tokens(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        slots = self._appended_slots()
        batch, heads = self.shape
        return (self.keys[slots].view(batch, heads, self.appended, -1),
                self.values[slots].view(batch, heads, self.appended, -1),
                self.columns[slots].view(batch, heads, self.appended))

    # ------------------------------------------------------------ writing
    def append(self, keys: torch.Tensor, values: torch.Tensor, first: int, columns: torch.Tensor | None = None) -> None:
        """Write ``[B, H_kv, q, d]`` new tokens after every sequence (one indexed write each for keys,
        values and columns), growing every sequence's room (doubling) only when it is full."""
        self._own()
        new = keys.shape[2]
        if self.appended + new > self.capacity:
            mean_kept = int(self.kept.sum()) // max(self.kept.numel(), 1)
            self._grow(self.appended + new + spare_slots(mean_kept + self.appended + new))
        slots = self._tail_starts + self.appended if new == 1 else self._appended_slots(self.appended, new).flatten()
        self.keys.index_copy_(0, slots, keys.reshape(-1, keys.shape[-1]))
        self.values.index_copy_(0, slots, values.reshape(-1, values.shape[-1]))
        if columns is None and new == 1:
            self.columns.index_fill_(0, slots, first)
        else:
            written = self.columns.new_empty(self.kept.numel(), new)
            self.holes = write_columns(written.view(*self.shape, new), first, new, columns) or self.holes
            self.columns.index_copy_(0, slots, written.flatten())
        self.appended += new

    def reserve(self, appends: int) -> None:
        """Make room for ``appends`` more appended tokens per sequence at once (a generation of known length)."""
        if self.appended + appends > self.capacity:
            self._grow(self.appended + appends)
            self._shared = False  # the grown buffers are this segment's own

    def _grow(self, capacity: int) -> None:
        lengths = self.kept + self.appended
        old = self._slots(lengths)
        self.capacity = capacity
        self.starts = _starts(self.kept, capacity)
        self._index_sequences()
        new, total = self._slots(lengths), int((self.kept + capacity).sum())
        for name in ("keys", "values", "columns"):
            tensor = getattr(self, name)
            grown = tensor.new_full((total, *tensor.shape[1:]), -1 if name == "columns" else 0)
            grown[new] = tensor[old]
            setattr(self, name, grown)

    def drop_appended(self, oldest: int = 0, newest: int = 0) -> None:
        self._own()
        keep = self.appended - oldest - newest
        slots = self._appended_slots()
        source, target = slots[:, oldest : oldest + keep].flatten(), slots[:, :keep].flatten()
        for tensor in (self.keys, self.values, self.columns):
            tensor[target] = tensor[source].clone()
        self.columns[slots[:, keep:].flatten()] = -1
        self.appended = keep

    # ------------------------------------------------------------ reading
    def attend(self, probe: Probe) -> Partial:
        """One kernel call per (row, KV head) sequence, read where it lies. When a summary reads the
        peak logit too (ResKV's gate), one product of every query row with the whole buffer, each
        row masked to its own sequence, gives output, log-sum-exp and peak at once."""
        if probe.need_peak or probe.need_count:
            return self._whole_buffer_partial(probe)
        batch, heads = self.shape
        stacked = probe.stacked
        parts = []
        for index, (start, kept) in enumerate(zip(self._start_list, self._lengths)):
            row, head = divmod(index, heads)
            stop = start + kept + self.appended
            keys, values = self.keys[None, None, start:stop], self.values[None, None, start:stop]
            if probe.value_heads is not None:  # the same tokens, read with another head's values
                source = self._start_list[row * heads + int(probe.value_heads[head])]
                values = self.values[None, None, source : source + stop - start]
            visible = None
            if self.holes or probe.masks_by_position:
                visible = probe.visibility(self.columns[None, None, start:stop])
            parts.append(attend_block(probe.with_queries(stacked[row : row + 1, head : head + 1]), keys, values,
                                      visible))
        return _stack_heads(parts, batch, heads)

    def _whole_buffer_partial(self, probe: Probe) -> Partial:
        """The partial of every query row over its own sequence, through one product with the buffer."""
        rows = probe.stacked.shape[2]
        visible = self._own_slots(rows) & (self.columns >= 0)[None, :]
        if probe.masks_by_position:
            visible = visible & probe.visibility(self.columns[None, None, :]).reshape(rows, -1).repeat(
                self.kept.numel(), 1)
        logits = torch.matmul(probe.stacked.reshape(-1, probe.stacked.shape[-1]), self.keys.transpose(0, 1)).float()
        if probe.softcap is not None:
            logits = torch.tanh(logits * (probe.scaling / probe.softcap)) * probe.softcap
        else:
            logits = logits * probe.scaling
        partial = softmax_partial(logits.masked_fill_(~visible, float("-inf")), self.values)
        count = visible.sum(dim=-1).view(*self.shape, rows) if probe.need_count else None
        return Partial(partial.output.view(*self.shape, rows, -1), partial.lse.view(*self.shape, rows),
                       partial.peak.view(*self.shape, rows), count)

    def _own_slots(self, rows: int) -> torch.Tensor:
        """``[B * H_kv * rows, N]`` bool: the buffer slots of each query row's own sequence."""
        if rows not in self._own_slot_masks:
            owner = torch.arange(self.kept.numel(), device=self.columns.device).repeat_interleave(rows)
            self._own_slot_masks[rows] = self._owner[None, :] == owner[:, None]
        return self._own_slot_masks[rows]

    # ------------------------------------------------------------ bookkeeping
    def nbytes(self) -> int:
        return tensor_bytes([self.keys, self.values, self.columns, self.kept, self.starts])

    def used_nbytes(self) -> int:
        held = int(self.kept.sum()) + self.kept.numel() * self.appended
        per_token = self.keys.shape[-1] * self.keys.element_size() + self.values.shape[-1] * self.values.element_size()
        return held * (per_token + 4) + tensor_bytes([self.kept, self.starts])

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values, self.columns, self.kept, self.starts]

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "RaggedTokens":
        keys, values, columns = (fn(t) for t in self.padded(appended=False))
        mapped = RaggedTokens(keys, values, columns, self.capacity)
        if self.appended:
            mapped.append_tokens(*(fn(t) for t in self.appended_tokens()))
        return mapped


def _starts(kept: torch.Tensor, capacity: int) -> torch.Tensor:
    """``[B * H_kv]`` int32 first buffer slot of each sequence (its kept tokens, then ``capacity``)."""
    lengths = kept + capacity
    return (torch.cumsum(lengths, 0) - lengths).to(torch.int32)


def _stack_heads(parts: list[Partial], batch: int, heads: int) -> Partial:
    """Per-(row, head) partials ``[1, 1, R, d]`` as one ``[B, H_kv, R, d]`` partial."""

    def stacked(field: int) -> torch.Tensor | None:
        tensors = [part[field] for part in parts]
        if tensors[0] is None:
            return None
        joined = torch.cat(tensors, dim=1)
        return joined.view(batch, heads, *joined.shape[2:])

    return Partial(*(stacked(field) for field in range(4)))


def exact_tokens(keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor,
                 capacity: int | None = None) -> DenseTokens | RaggedTokens:
    """The segment that holds kept tokens ``[B, H_kv, S, d]`` at ``columns`` (-1 = unused slot):
    ragged when the dense layout would leave more than ``RAGGED_WASTE`` of its slots empty."""
    slots = columns.numel()
    used = int((columns >= 0).sum())
    if slots and used < (1.0 - RAGGED_WASTE) * slots:
        return RaggedTokens(keys, values, columns, capacity)
    return DenseTokens(keys, values, columns, capacity)



def joined_view(segments: list, appended: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every exact token of ``segments`` as one padded view ``(keys, values, columns)``
    ``[B, H_kv, S, d]``: each head's tokens first, in the segments' order (ascending positions),
    then unused slots (column -1); ``appended``: with the tokens appended since compression."""
    views = [segment.padded(appended) for segment in segments]
    keys = torch.cat([view[0] for view in views], dim=2)
    values = torch.cat([view[1] for view in views], dim=2)
    columns = torch.cat([view[2].to(torch.int32) for view in views], dim=2)
    order = torch.sort((columns < 0).to(torch.int8), dim=-1, stable=True).indices  # held slots first, in order
    width = int((columns >= 0).sum(dim=-1).max()) if columns.numel() else 0
    order = order[..., :width]
    columns = columns.gather(2, order)
    held = (columns >= 0)[..., None]
    keys = keys.gather(2, order[..., None].expand(-1, -1, -1, keys.shape[-1])).masked_fill(~held, 0)
    values = values.gather(2, order[..., None].expand(-1, -1, -1, values.shape[-1])).masked_fill(~held, 0)
    return keys, values, columns
