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

``entries_for`` picks the ragged store when padding would waste more than ``RAGGED_WASTE``
of the slots.
"""

from __future__ import annotations

import torch

#: the share of padded slots above which a layer is stored ragged
RAGGED_WASTE = 0.02


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
        """``[B, H_kv, 0, d]`` (the shape of no token)."""
        return self.keys[:, :, :0]

    def tensors(self) -> list[torch.Tensor]:
        """What the store holds (for the memory report)."""
        return [self.keys, self.values, self.columns]


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
        return self.keys.new_zeros(batch, heads, 0, self.keys.shape[-1])

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values, self.columns, self.exact, self.residual]


def entries_for(keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor,
                residual_counts: torch.Tensor) -> DenseEntries | RaggedEntries:
    """The store of a layer's padded entries: ragged when padding would waste more than
    ``RAGGED_WASTE`` of the slots (``residual_counts`` ``[B, H_kv]``: entries in the last slots)."""
    columns = columns.to(torch.int32)
    slots = columns.numel()
    used = int((columns >= 0).sum()) + int(residual_counts.sum())
    if slots and used < (1.0 - RAGGED_WASTE) * slots:
        return RaggedEntries(keys, values, columns, residual_counts)
    return DenseEntries(keys, values, columns)
