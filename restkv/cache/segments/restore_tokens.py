"""RestoreKV's summary segment (``--method restorekv``): the restore tokens' keys and values, made by one
pass over the whole context before eviction (``restkv.policies.restorekv``), read by every later query as
ordinary entries of its softmax."""

from __future__ import annotations

import torch

from restkv.cache.partial import Partial, Probe, attend_block, merge
from restkv.cache.segments.base import SegmentReport, tensor_bytes


class RestoreTokens:
    """A summary segment: ``n`` restore tokens per row and KV head, keys (post-RoPE, at the positions their
    pass gave them) and values ``[B, H_kv, n, d]``. They stand for what the evictor drops, fill ``n``
    slots of each head's budget, and are visible to every query that comes after them (the question and
    the answer: they are made after the whole context)."""

    kind = "restore tokens"
    needs_peak = False
    needs_count = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if keys.dim() != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"restore keys {list(keys.shape)} and values {list(values.shape)} must be "
                             "[B, H_kv, n, d] alike")
        self.keys, self.values = keys, values

    def counts(self) -> torch.Tensor:
        """``[B, H_kv]`` restore tokens per head (every head holds them all)."""
        return torch.full(self.keys.shape[:2], self.keys.shape[2], dtype=torch.long)

    def budget_slots(self) -> torch.Tensor:
        """``[B, H_kv]`` slots of the budget they fill: one each."""
        return self.counts()

    def join(self, current: Partial, exact: Partial, probe: Probe) -> Partial:
        return merge([current, attend_block(probe, self.keys, self.values, None)], statistics=False)

    def as_slots(self):
        """The restore tokens as the last slots of ``restkv.pipeline.compress.CompressedKV``: ``(keys, values,
        log_counts [B, H_kv, n]`` (0: each stands for itself), no oldest positions, no value maps)."""
        return self.keys, self.values, torch.zeros(self.keys.shape[:3]), None, None

    def report(self) -> SegmentReport:
        return SegmentReport(self.kind, None, float(self.keys.shape[2]), self.nbytes())

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values]

    def nbytes(self) -> int:
        return tensor_bytes(self.tensors())

    def fork(self) -> "RestoreTokens":
        return self

    def map_batch(self, fn) -> "RestoreTokens":
        return RestoreTokens(fn(self.keys), fn(self.values))
