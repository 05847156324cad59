"""How attention reads residual entries (ResKV, arXiv 2607.29591), and the segment that holds them.

Residual entries join the exact entries in one softmax with logit
``scale <q, k_mean> + beta log c + log g(q)``; the gate
``g(q) = max(g_min, sigmoid(alpha (tau - p_max(q))))`` turns the residual branch down when
the query's attention over the exact entries is sharp. The paper gives the gate and the count's
exponent; the logit's form and adding ``log g`` to it (scaling the entry's mass, so ``g = 0`` is
plain eviction exactly) are our reading. ``p_max`` is the largest weight of the
exact entries' own softmax, ``exp(peak - lse)`` of their partial (``restkv.cache.partial``), so the
entries are read as one more partial that joins the exact one by log-sum-exp
(``ResidualReadout.join``): the same read-out serves decode steps (``ResidualEntries``, a
summary segment of a compressed layer) and the validation proxy that picks each head's ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from restkv.cache.partial import Partial, Probe, merge, mix_separately, scaled_logits, softmax_partial
from restkv.cache.segments.base import SegmentReport, tensor_bytes


@dataclass(frozen=True)
class ResidualReadout:
    """How attention reads residual entries: count exponent, gate and normalisation.

    beta: exponent of the member count (``beta log c`` is added to the entry's logit).
    gate: apply the dynamic gate; ``tau``, ``alpha`` (= 1 / T_g) and ``gate_min`` are its
        threshold, slope and floor.
    separate_softmax: the ablation that normalises main and residual entries apart and mixes
        the two outputs with ``omega = g n_E / (n_E + |M|)`` (``n_E`` = members behind the
        visible entries, ``|M|`` = visible exact entries).
    """

    beta: float = 1.0
    gate: bool = True
    tau: float = 0.25
    alpha: float = 12.0
    gate_min: float = 0.0
    separate_softmax: bool = False

    def log_gate(self, exact: Partial) -> torch.Tensor:
        """``log g(q)`` ``[..., R]`` from the exact partial's peak and log-sum-exp (``p_max = 0`` for
        a row that sees no exact entry, which only the causal validation probe can meet); 0
        without the gate."""
        if not self.gate:
            return torch.zeros_like(exact.lse)
        p_max = torch.exp(exact.peak - exact.lse).nan_to_num_(0.0)  # -inf - -inf: a row that sees nothing
        log_g = F.logsigmoid(p_max.mul_(-self.alpha).add_(self.alpha * self.tau))  # logsigmoid keeps tiny gates accurate
        if self.gate_min > 0:
            log_g = log_g.clamp(min=math.log(self.gate_min))
        return log_g

    def bias(self, log_counts: torch.Tensor) -> torch.Tensor:
        """``beta log c`` of every entry slot, ``-inf`` where the slot holds none."""
        return torch.where(torch.isfinite(log_counts), self.beta * log_counts, float("-inf"))

    def join(self, current: Partial, exact: Partial, logits: torch.Tensor, values: torch.Tensor,
             log_counts: torch.Tensor, visible: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> Partial:
        """``current`` (the partial so far) with the entries read in.

        exact: the exact tokens' partial (the gate reads it; the separate softmax its count).
        logits: ``[..., R, E]`` float32 ``scale <q, k_mean>`` of the entries (soft-capped);
        values: ``[..., E, d]``; log_counts: ``[..., 1 | R, E]`` ``log c`` (``-inf``: no entry),
        and ``bias`` its ``self.bias`` when the caller keeps it; visible: optional bool
        broadcastable to the logits (a sliding window's past).
        """
        bias = self.bias(log_counts) if bias is None else bias
        entry = torch.isfinite(bias) if visible is None else torch.isfinite(bias) & visible
        biased = torch.where(entry, logits + bias, float("-inf"))  # whatever an unused slot holds
        if self.separate_softmax:
            side = softmax_partial(biased, values, peak=False)
            members = torch.where(torch.isfinite(biased), log_counts.exp(), 0.0).sum(dim=-1).expand_as(exact.lse)
            omega = torch.exp(self.log_gate(exact)) * members / (members + exact.count)
            return mix_separately(current, side, omega)
        if self.gate:
            biased = biased + self.log_gate(exact)[..., None]
        return merge([current, softmax_partial(biased, values, peak=False)], statistics=False)


class ResidualEntries:
    """A summary segment: ResKV's residual entries of one layer, read with their gate.

    keys, values: ``[B, H_kv, R, d]`` (a head with ``r`` entries uses its last ``r`` slots; zeros
    elsewhere); log_counts: ``[B, H_kv, R]`` float32 ``log c`` (``-inf``: no entry); oldest:
    ``[B, H_kv, R]`` int32 padded-batch column of each entry's oldest member (-1: no entry), or
    None where unknown (entries folded over several compressions); on a sliding-window layer an
    entry is visible while its oldest member is.
    """

    kind = "reskv entries"

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, log_counts: torch.Tensor,
                 readout: ResidualReadout, oldest: torch.Tensor | None = None) -> None:
        self._keys, self._values, self.log_counts = keys, values, log_counts
        self.readout = readout
        self.oldest = None if oldest is None else oldest.to(torch.int32)
        #: the exact segment whose buffer holds the entries in its slots ``host_slots`` (its bytes count
        #: them; ``restkv.pipeline.compress.co_locate``), or None: the entries hold their own tensors
        self.host, self.host_slots = None, None
        self._bias = readout.bias(log_counts)[:, :, None, :]  # what every read adds to the entries' logits

    @property
    def hosted(self) -> bool:
        return self.host is not None

    @property
    def keys(self) -> torch.Tensor:
        return self._keys if self.host is None else self.host.keys[:, :, self.host_slots]

    @property
    def values(self) -> torch.Tensor:
        return self._values if self.host is None else self.host.values[:, :, self.host_slots]

    def hosted_by(self, host, slots: slice) -> "ResidualEntries":
        """The same entries read from slots ``slots`` of ``host``'s buffer (a ``DenseTokens`` that
        holds them after its exact tokens: ``restkv.pipeline.compress.co_locate``)."""
        entries = ResidualEntries(None, None, self.log_counts, self.readout, self.oldest)
        entries.host, entries.host_slots = host, slots
        return entries

    @property
    def needs_peak(self) -> bool:
        return self.readout.gate

    @property
    def needs_count(self) -> bool:
        return self.readout.separate_softmax

    def counts(self) -> torch.Tensor:
        """``[B, H_kv]`` entries per head."""
        return torch.isfinite(self.log_counts).sum(dim=-1)

    budget_slots = counts  # one token slot an entry

    def heads(self, head: int) -> "ResidualEntries":
        """The entries of KV head ``head`` alone (``[B, 1, R]``)."""
        return self.map_heads(lambda t: t[:, head : head + 1])

    def map_heads(self, fn) -> "ResidualEntries":
        return ResidualEntries(fn(self.keys), fn(self.values), fn(self.log_counts), self.readout,
                               None if self.oldest is None else fn(self.oldest))

    @classmethod
    def joined_heads(cls, parts: list["ResidualEntries"]) -> "ResidualEntries":
        """One segment of per-head segments (``[B, 1, R_h]`` each, right-aligned in the widest ``R``)."""
        width = max(part.keys.shape[2] for part in parts)

        def joined(tensors: list[torch.Tensor], fill: float) -> torch.Tensor:
            grown = [torch.nn.functional.pad(t, (0, 0, width - t.shape[2], 0) if t.dim() == 4
                                             else (width - t.shape[2], 0), value=fill) for t in tensors]
            return torch.cat(grown, dim=1)

        oldest = None if parts[0].oldest is None else joined([part.oldest for part in parts], -1)
        return cls(joined([part.keys for part in parts], 0), joined([part.values for part in parts], 0),
                   joined([part.log_counts for part in parts], float("-inf")), parts[0].readout, oldest)

    def join(self, current: Partial, exact: Partial, probe: Probe) -> Partial:
        visible = None
        if probe.sliding_window is not None and self.oldest is not None:
            visible = probe.visibility(self.oldest)
        logits = scaled_logits(probe, self.keys)
        return self.readout.join(current, exact, logits, self.values, self.log_counts[:, :, None, :], visible,
                                 self._bias)

    def reads_with_host(self, probe: Probe) -> bool:
        """Whether a step reads the entries and their host's tokens in one pass (``read_with_host``): entries
        co-located in an exact segment's buffer, joined in one softmax."""
        return self.host is not None and not self.readout.separate_softmax and probe.value_heads is None

    def read_with_host(self, probe: Probe) -> Partial:
        """The host's exact tokens and the entries in its slots as one softmax from one product of the step's
        queries with the host's buffer: the exact columns give the peak and log-sum-exp the gate reads, the
        entry columns take ``beta log c + log g(q)``; then one softmax and one product with the buffer's values."""
        keys, values, columns = self.host.padded()
        logits = scaled_logits(probe, keys)
        exact = logits.masked_fill(~probe.visibility(columns), float("-inf"))
        slots = self.host_slots
        entry = torch.isfinite(self._bias)  # a head with fewer entries keeps exact tokens in its other slots
        if probe.sliding_window is not None and self.oldest is not None:
            entry = entry & probe.visibility(self.oldest)
        entry_logits = logits[..., slots] + self._bias
        if self.readout.gate:
            peak, lse = exact.amax(dim=-1), torch.logsumexp(exact, dim=-1)
            entry_logits = entry_logits + self.readout.log_gate(Partial(None, lse, peak))[..., None]
        exact[..., slots] = torch.where(entry, entry_logits, exact[..., slots])
        return softmax_partial(exact, values, peak=False)

    def as_slots(self):
        """``(keys, values [B, H_kv, R, d], log_counts [B, H_kv, R], oldest or None, value maps None)``:
        the entries as the last slots of ``restkv.pipeline.compress.CompressedKV``."""
        return self.keys, self.values, self.log_counts, self.oldest, None

    def report(self) -> SegmentReport:
        return SegmentReport(self.kind, None, float(self.counts().float().mean()), self.nbytes())

    def tensors(self) -> list[torch.Tensor]:
        own = (self.log_counts, self._bias, self.oldest) if self.hosted else \
            (self.keys, self.values, self.log_counts, self._bias, self.oldest)
        return [t for t in own if t is not None]

    def nbytes(self) -> int:
        return tensor_bytes(self.tensors())

    def fork(self) -> "ResidualEntries":
        return self  # never written in place

    map_batch = map_heads


def capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The model's logit soft-cap (Gemma 2), applied to dot products before any bias."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap
