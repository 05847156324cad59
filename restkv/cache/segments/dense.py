"""``exact dense``: every head's sequence at the same slots of one ``[B, H_kv, W, d]`` buffer; a step
reads one contiguous block with one kernel call (no mask without holes)."""

from __future__ import annotations

from typing import Callable

import torch

from restkv.cache.partial import Partial, Probe, attend_block
from restkv.cache.segments.base import ExactTokens, spare_slots, tensor_bytes, write_columns


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

    @property
    def slot_count(self) -> int:
        return self.used

    def write_slots(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Copy the used slots into a shared buffer (``restkv.cache.segments.base.SlotWriter``)."""
        own_keys, own_values, columns = self.padded()
        keys.copy_(own_keys)
        values.copy_(own_values)
        return columns

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
