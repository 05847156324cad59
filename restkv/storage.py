"""How a compressed layer holds its kept entries, so that memory follows the budgets.

The read path (``restkv.cache.CompressedLayer.attend``) works on a padded view, one
``[B, H_kv, S, d]`` block per layer in which each (row, KV head) fills its first slots with
its exact tokens (ascending positions) and its last slots with its residual entries; ``S`` is
the widest head's count. Two stores give that view:

* ``DenseEntries`` holds the view itself: nothing to rebuild, and no waste when every head
  keeps the same number of entries (uniform budgets);
* ``RaggedEntries`` holds each (row, KV head)'s entries back to back (``[sum of counts, d]``
  and the counts per head), so head-adaptive budgets (AdaKV, HeadKV, KVzip, ...) cost what
  they allocate; the padded view is rebuilt when read, one layer at a time.

A third store holds the padded view quantised (``--quant_method``):

* ``QuantizedEntries`` keeps packed integer codes with their scales and zero-points
  (``restkv.quantization``), and the exact columns; attention reads it one block of
  ``READ_BLOCK`` slots at a time (``read_blocks``), so no full-precision copy of the layer
  is ever held. Padding slots are stored too (as codes), so head-adaptive budgets pay
  ``nbits / 16`` of a 16-bit slot for each unused one.

``entries_for`` picks the quantised store when the run quantises, else the ragged one when
padding would waste more than ``RAGGED_WASTE`` of the slots.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch

#: the share of padded slots above which a layer is stored ragged
RAGGED_WASTE = 0.02
#: slots a quantised store dequantises at once when attention reads it (rounded to whole key groups)
READ_BLOCK = 1024

#: one block of a store's padded view: first slot, end slot, keys and values ``[B, H_kv, stop - start, d]``
#: (or functions that return them)
Block = tuple[int, int, Any, Any]


class DenseEntries:
    """A layer's entries as their padded view (see the module docstring)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor) -> None:
        self.keys, self.values, self.columns = keys, values, columns

    def read(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, values, columns)``: ``[B, H_kv, S, d]`` twice and ``[B, H_kv, S]`` int32
        (the position of each exact token; -1 for residual entries and unused slots)."""
        return self.keys, self.values, self.columns

    def exact_counts(self) -> torch.Tensor:
        """``[B, H_kv]`` exact tokens per head."""
        return (self.columns >= 0).sum(dim=-1)

    def empty(self) -> torch.Tensor:
        """``[B, H_kv, 0, d]`` (the shape of no token; ``d`` of the values, whole when keys are pruned)."""
        return self.values[:, :, :0]

    def read_blocks(self) -> tuple[torch.Tensor, list[Block]]:
        """The padded view's columns and its entries as blocks of slots (one block here)."""
        return _one_block(*self.read())

    def tensors(self) -> list[torch.Tensor]:
        """What the store holds (for the memory report)."""
        return [self.keys, self.values, self.columns]

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor], residual_counts: torch.Tensor):
        """The store with ``fn`` (a batch reorder, repeat or selection) applied to its rows;
        ``residual_counts``: the mapped rows' residual entries per head."""
        return entries_for(*(fn(tensor) for tensor in self.read()), residual_counts)


class RaggedEntries:
    """Each (row, KV head)'s exact tokens, then its residual entries, back to back (read back
    with the exact tokens in the first slots, in their order, and the residual entries in the
    last).

    keys, values: ``[N, d]``; columns: ``[N_exact]`` int32 positions of the exact tokens;
    exact, residual: ``[B, H_kv]`` int32 entries of each kind per head, which give every entry
    its slot of the padded view (exact ones first, residual ones last).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor,
                 residual_counts: torch.Tensor) -> None:
        batch, heads, width, dim = keys.shape
        self.width = width
        self.exact = (columns >= 0).sum(dim=-1).to(torch.int32)
        self.residual = residual_counts.to(torch.int32)
        # Exact tokens wherever they sit (in slot order), residual entries in the last slots.
        slot = torch.arange(width, device=keys.device)
        taken = (columns >= 0) | (slot >= width - self.residual[..., None])
        self.keys, self.values = keys[taken], values[taken]
        self.columns = columns[columns >= 0].to(torch.int32)

    def _layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For every stored entry: its (row, head) segment, its slot in the padded view, and
        whether it is an exact token."""
        exact = self.exact.flatten().long()
        counts = exact + self.residual.flatten().long()
        segment = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
        within = torch.arange(segment.numel(), device=counts.device) - (torch.cumsum(counts, 0) - counts)[segment]
        is_exact = within < exact[segment]
        slot = torch.where(is_exact, within, self.width - counts[segment] + within)
        return segment, slot, is_exact

    def read(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The padded view (see ``DenseEntries.read``), rebuilt."""
        batch, heads = self.exact.shape
        segment, slot, exact = self._layout()
        keys = self.keys.new_zeros(batch * heads, self.width, self.keys.shape[-1])
        values = self.values.new_zeros(batch * heads, self.width, self.values.shape[-1])
        keys[segment, slot], values[segment, slot] = self.keys, self.values
        columns = torch.full((batch * heads, self.width), -1, dtype=torch.int32, device=self.columns.device)
        columns[segment[exact], slot[exact]] = self.columns
        return (keys.view(batch, heads, self.width, -1), values.view(batch, heads, self.width, -1),
                columns.view(batch, heads, self.width))

    def exact_counts(self) -> torch.Tensor:
        return self.exact.long()

    def empty(self) -> torch.Tensor:
        batch, heads = self.exact.shape
        return self.values.new_zeros(batch, heads, 0, self.values.shape[-1])

    def read_blocks(self) -> tuple[torch.Tensor, list[Block]]:
        return _one_block(*self.read())

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values, self.columns, self.exact, self.residual]

    map_batch = DenseEntries.map_batch


class QuantizedEntries:
    """A layer's padded view with keys and values quantised by ``quantizer`` (a
    ``restkv.quantization`` part): codes of every slot, scales and zero-points of slots that
    hold an entry (exact tokens and residual entries), and the exact tokens' columns."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor,
                 residual_counts: torch.Tensor, quantizer: Any) -> None:
        width = keys.shape[2]
        held = (columns >= 0) | (torch.arange(width, device=keys.device) >= width - residual_counts[..., None])
        self.quantizer = quantizer
        self.keys = quantizer.quantize_keys(keys, held)
        self.values = quantizer.quantize_values(values, held)
        self.columns = columns.to(torch.int32)

    @classmethod
    def _of(cls, keys, values, columns, quantizer) -> "QuantizedEntries":
        store = cls.__new__(cls)
        store.keys, store.values, store.columns, store.quantizer = keys, values, columns, quantizer
        return store

    def read(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The padded view, dequantised (a temporary copy; attention reads ``read_blocks``)."""
        return self.keys.dequantize(), self.values.dequantize(), self.columns

    def read_blocks(self) -> tuple[torch.Tensor, list[Block]]:
        """The columns, and blocks of ``READ_BLOCK`` slots that dequantise when called."""
        group = self.keys.group
        size = max(group, READ_BLOCK // group * group)
        width = self.columns.shape[-1]
        return self.columns, [
            (start, min(start + size, width), partial(self.keys.dequantize, start, min(start + size, width)),
             partial(self.values.dequantize, start, min(start + size, width)))
            for start in range(0, width, size)
        ]

    def exact_counts(self) -> torch.Tensor:
        return (self.columns >= 0).sum(dim=-1)

    def empty(self) -> torch.Tensor:
        batch, heads = self.columns.shape[:2]
        return torch.zeros(batch, heads, 0, self.values.channels, dtype=self.values.dtype, device=self.columns.device)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.keys.tensors(), *self.values.tensors(), self.columns]

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor], residual_counts: torch.Tensor):
        """The codes of the mapped rows (nothing is quantised again)."""
        return QuantizedEntries._of(self.keys.map_batch(fn), self.values.map_batch(fn), fn(self.columns),
                                    self.quantizer)


def _one_block(keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor) -> tuple[torch.Tensor, list[Block]]:
    return columns, [(0, keys.shape[2], keys, values)]


def entries_for(keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor, residual_counts: torch.Tensor,
                quantizer: Any = None) -> DenseEntries | RaggedEntries | QuantizedEntries:
    """The store of a layer's padded entries: quantised with ``quantizer`` if given, else ragged
    when padding would waste more than ``RAGGED_WASTE`` of the slots (``residual_counts``
    ``[B, H_kv]``: entries in the last slots)."""
    if quantizer is not None:
        return QuantizedEntries(keys, values, columns, residual_counts, quantizer)
    columns = columns.to(torch.int32)
    slots = columns.numel()
    used = int((columns >= 0).sum()) + int(residual_counts.sum())
    if slots and used < (1.0 - RAGGED_WASTE) * slots:
        return RaggedEntries(keys, values, columns, residual_counts)
    return DenseEntries(keys, values, columns)
