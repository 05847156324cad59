"""ThinK's pruned keys (``--think``): a segment that holds an inner exact or quantised segment's keys
with only each head's kept channels, read with the query channels that meet them (the same as
masking the dropped ones)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from restkv.cache.partial import attend_block
from restkv.cache.segments.base import tensor_bytes
from restkv.cache.segments.dense import DenseTokens


class PrunedKeyTokens:
    """Exact tokens whose keys hold only each head's kept channels (ThinK): a segment that reads
    its ``inner`` segment (dense, ragged or quantised, holding the compact ``[.., d - pruned]``
    keys) with the query channels that meet them, the same as masking the dropped ones.

    channels: ``[B, H_kv, c]`` ascending kept channels per head; head_dim: the keys' full width.
    """

    def __init__(self, inner, channels: torch.Tensor, head_dim: int) -> None:
        self.inner, self.channels, self.head_dim = inner, channels, head_dim

    @property
    def kind(self) -> str:
        return f"{self.inner.kind}, keys {self.channels.shape[-1]}/{self.head_dim} channels"

    @property
    def storage(self) -> str:
        inner = getattr(self.inner, "storage", "exact")
        pruned = f"keys {self.channels.shape[-1]}/{self.head_dim} channels"
        return pruned if inner == "exact" else f"{inner}, {pruned}"

    def attend(self, probe):
        """The kept query channels against the compact keys. On the CPU both are zero-padded back to
        the head dimension (zeros add nothing to a dot product), so the fused kernel that returns
        the log-sum-exp reads them; the inner segment reads them itself elsewhere."""
        stacked = probe.stacked
        index = self.channels[:, :, None, :].expand(-1, -1, stacked.shape[2], -1)
        queries = stacked.gather(-1, index)
        if stacked.device.type != "cpu" or not isinstance(self.inner, DenseTokens):
            return self.inner.attend(probe.with_queries(queries))
        compact, values, columns = self.inner.padded()
        padding = (0, self.head_dim - compact.shape[-1])
        visible = probe.visibility(columns) if self.inner.holes or probe.masks_by_position else None
        return attend_block(probe.with_queries(F.pad(queries, padding)), F.pad(compact, padding), values, visible)

    @property
    def _ragged(self) -> bool:
        """Whether the inner segment keeps each head's tokens apart (``write_slots`` then reads its padded view)."""
        return not hasattr(type(self.inner), "slot_count")

    @property
    def holes(self) -> bool:
        """Whether its slots include holes: a ragged inner segment's padded view has them where heads keep fewer."""
        return True if self._ragged else self.inner.holes

    @property
    def slot_count(self) -> int:
        return self.inner.padded()[2].shape[-1] if self._ragged else self.inner.slot_count

    def write_slots(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The compact keys scattered into whole-width slots of a shared buffer, zeros in the dropped
        channels, so the step's whole queries read them (``restkv.cache.segments.base.SlotWriter``)."""
        compact, own_values, columns = self.inner.padded()
        keys.zero_().scatter_(-1, self.channels[:, :, None, :].expand(-1, -1, compact.shape[2], -1), compact)
        values.copy_(own_values)
        return columns

    def padded(self, appended: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kept tokens with whole keys (zeros in the dropped channels)."""
        compact, values, columns = self.inner.padded()
        keys = compact.new_zeros(*compact.shape[:-1], self.head_dim)
        keys.scatter_(-1, self.channels[:, :, None, :].expand(-1, -1, compact.shape[2], -1), compact)
        return keys, values, columns

    def kept_counts(self) -> torch.Tensor:
        return self.inner.kept_counts()

    def held_counts(self) -> torch.Tensor:
        return self.inner.held_counts()

    def report(self):
        inner = self.inner.report()
        channels = tensor_bytes([self.channels])
        return dataclasses.replace(inner, kind=self.kind, nbytes=inner.nbytes + channels,
                                   used_nbytes=inner.used_nbytes + channels)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.inner.tensors(), self.channels]

    def nbytes(self) -> int:
        return self.inner.nbytes() + tensor_bytes([self.channels])

    def fork(self) -> "PrunedKeyTokens":
        return self  # built once, never appended to

    def map_batch(self, fn) -> "PrunedKeyTokens":
        return PrunedKeyTokens(self.inner.map_batch(fn), fn(self.channels), self.head_dim)
