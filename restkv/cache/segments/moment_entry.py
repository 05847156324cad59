"""MomentKV's summary segment (``--moments``): the evicted set's first-order entry per row and KV head,
joining the exact tokens' softmax with key ``mu_k``, log-mass ``log n`` and the query-dependent
value ``mu_v + s C q`` (``restkv.switches.moments``)."""

from __future__ import annotations

import torch

from restkv.cache.partial import Partial, Probe, merge, mix_separately, scaled_logits
from restkv.cache.segments.base import SegmentReport, tensor_bytes


class MomentEntry:
    """A summary segment: the evicted set's first-order entry, per row and KV head.

    Its logit is ``s <q, mu_k> + log n`` and its value the query-dependent ``mu_v + s C q``; it
    joins the exact tokens' softmax (or, ``outside_softmax``, is normalised apart and mixed in
    with weight ``n / (n + |M|)``). key_mean, value_mean: ``[B, H_kv, d]``; log_count: ``[B, H_kv]``
    (``-inf``: the head keeps no statistics); covariance: ``[B, H_kv, d, d]`` or None; oldest:
    ``[B, H_kv]`` padded-batch column of the oldest evicted token (sliding-window layers), or None;
    slot_cost: token slots of the budget the statistics of one head take (0: stored on top of it).
    """

    kind = "momentkv entry"
    needs_peak = False

    def __init__(self, key_mean: torch.Tensor, value_mean: torch.Tensor, log_count: torch.Tensor,
                 covariance: torch.Tensor | None, oldest: torch.Tensor | None, outside_softmax: bool,
                 slot_cost: int = 0) -> None:
        self.key_mean, self.value_mean, self.log_count = key_mean, value_mean, log_count
        self.covariance, self.outside_softmax, self.slot_cost = covariance, outside_softmax, slot_cost
        self.oldest = None if oldest is None else oldest.to(torch.int32)

    @property
    def needs_count(self) -> bool:
        return self.outside_softmax

    def counts(self) -> torch.Tensor:
        """``[B, H_kv]`` entries per head (1 where the head keeps statistics)."""
        return torch.isfinite(self.log_count).long()

    def budget_slots(self) -> torch.Tensor:
        """``[B, H_kv]`` token slots of the budget the statistics take."""
        return self.counts() * self.slot_cost

    def join(self, current: Partial, exact: Partial, probe: Probe) -> Partial:
        logit = scaled_logits(probe, self.key_mean[:, :, None])[..., 0]  # [B, H_kv, R]
        lse = logit + self.log_count[..., None]  # -inf on heads without statistics
        if probe.sliding_window is not None and self.oldest is not None:
            lse = lse.masked_fill(~probe.visibility(self.oldest[..., None])[..., 0], float("-inf"))
        value = self.value_mean[:, :, None].float()
        if self.covariance is not None:  # the first-order term s C q
            value = value + probe.scaling * torch.einsum("bkvd,bkrd->bkrv", self.covariance.float(),
                                                         probe.stacked.float())
        side = Partial(value.expand(*lse.shape, -1), lse)
        if self.outside_softmax:
            members = torch.where(torch.isfinite(lse), self.log_count.exp()[..., None], 0.0)
            return mix_separately(current, side, members / (members + exact.count))
        return merge([current, side], statistics=False)

    def merged_with(self, old: "MomentEntry") -> "MomentEntry":
        """The statistics of this entry's tokens and ``old``'s together (counts add, means weigh
        by them, the cross-covariance gains the means' difference: Chan et al.'s pairwise update),
        on every head that holds either."""
        n_new, n_old = (torch.where(torch.isfinite(e.log_count), e.log_count.exp(), 0.0)[..., None]
                        for e in (self, old))
        total = (n_new + n_old).clamp(min=1)

        def mean(new: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
            return ((new.float() * n_new + previous.float() * n_old) / total).to(new.dtype)

        covariance = None
        if self.covariance is not None:
            key_gap, value_gap = self.key_mean.float() - old.key_mean.float(), self.value_mean.float() - old.value_mean.float()
            spread = (n_new * n_old / total)[..., None] * value_gap[..., :, None] * key_gap[..., None, :]
            covariance = ((self.covariance.float() * n_new[..., None] + old.covariance.float() * n_old[..., None]
                           + spread) / total[..., None]).to(self.covariance.dtype)
        counts = (n_new + n_old)[..., 0]
        log_count = torch.where(counts > 0, counts.clamp(min=1).log(), float("-inf"))
        oldest = None
        if self.oldest is not None and old.oldest is not None:
            oldest = torch.where(old.oldest >= 0, old.oldest, self.oldest)
        return MomentEntry(mean(self.key_mean, old.key_mean), mean(self.value_mean, old.value_mean), log_count,
                           covariance, oldest, self.outside_softmax, self.slot_cost)

    def as_slots(self):
        """The entry as one last slot of ``restkv.pipeline.compress.CompressedKV``: ``(keys, values [B, H_kv, 1, d],
        log_counts [B, H_kv, 1], oldest or None, value maps [B, H_kv, 1, d, d] or None)``."""
        maps = None if self.covariance is None else self.covariance[:, :, None]
        oldest = None if self.oldest is None else self.oldest[..., None]
        return self.key_mean[:, :, None], self.value_mean[:, :, None], self.log_count[..., None], oldest, maps

    def slots(self) -> float:
        """Token-slot equivalents per row and KV head: the entry, and ``C`` in ``2 d``-number slots."""
        per_head = 1.0 + (self.covariance.shape[-1] / 2 if self.covariance is not None else 0.0)
        return float(self.counts().float().mean()) * per_head

    def report(self) -> SegmentReport:
        return SegmentReport(self.kind, None, self.slots(), self.nbytes())

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.key_mean, self.value_mean, self.log_count, self.covariance, self.oldest)
                if t is not None]

    def nbytes(self) -> int:
        return tensor_bytes(self.tensors())

    def fork(self) -> "MomentEntry":
        return self

    def map_batch(self, fn) -> "MomentEntry":
        return MomentEntry(fn(self.key_mean), fn(self.value_mean), fn(self.log_count),
                           None if self.covariance is None else fn(self.covariance),
                           None if self.oldest is None else fn(self.oldest), self.outside_softmax, self.slot_cost)
