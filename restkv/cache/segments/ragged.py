"""``exact ragged``: each (row, KV head)'s sequence back to back in one ``[N, d]`` buffer, so
head-adaptive budgets hold what they allocate; a step reads each sequence where it lies."""

from __future__ import annotations

from typing import Callable

import torch

from restkv.cache.partial import Partial, Probe, attend_block, softmax_partial
from restkv.cache.segments.base import ExactTokens, spare_slots, tensor_bytes, write_columns


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
