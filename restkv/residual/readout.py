"""How attention reads residual entries (ResKV, ALGORITHMS.md 3.5-3.10).

Residual entries join the exact entries in one softmax with logit
``scale <q, k_mean> + beta log c + log g(q)``; the gate
``g(q) = max(g_min, sigmoid(alpha (tau - p_max(q))))`` turns the residual branch down when
the query's attention over the exact entries is sharp. Two forms of the same read-out:
decode and question chunks use one softmax over the segments (``ResidualReadout.weights``);
the validation proxy normalises the exact entries on their own and combines them with the
residual entries through their log-sum-exps (``ResidualReadout.mix``, ``combine_by_lse``,
3.10), the form a fused attention kernel that returns its log-sum-exp would use. Tests hold
the two equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

#: the logit of a masked column (finite, so a row with nothing visible never yields NaN)
MASKED = torch.finfo(torch.float32).min


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

    @classmethod
    def from_config(cls, config, validation: bool = False) -> "ResidualReadout":
        """The readout of a ``CompressionConfig`` with ``--residual`` (``ResidualCache.readout``)."""
        return config.switch("residual").readout(validation)

    def log_gate(self, exact_logits: torch.Tensor) -> torch.Tensor:
        """``log g(q)`` ``[..., 1]`` from the logits of the exact entries ``[..., S]`` (masked
        columns at ``MASKED``); 0 without the gate. ``p_max`` is the largest weight of the exact
        entries' own softmax (0 for a query that sees none, which only the causal validation
        probe can meet)."""
        if not self.gate:
            return exact_logits.new_zeros(exact_logits.shape[:-1] + (1,))
        seen = exact_logits.amax(dim=-1, keepdim=True) > MASKED
        p_max = torch.where(seen, torch.softmax(exact_logits, dim=-1).amax(dim=-1, keepdim=True), 0.0)
        return self._gate_of(p_max)

    def _gate_of(self, p_max: torch.Tensor) -> torch.Tensor:
        """``log max(g_min, sigmoid(alpha (tau - p_max)))``; ``logsigmoid`` keeps tiny gates accurate."""
        log_g = F.logsigmoid(self.alpha * (self.tau - p_max))
        if self.gate_min > 0:
            log_g = log_g.clamp(min=math.log(self.gate_min))
        return log_g

    def gate_value(self, exact_logits: torch.Tensor) -> torch.Tensor:
        """``g(q)`` ``[..., 1]`` (1 without the gate)."""
        return torch.exp(self.log_gate(exact_logits))

    def weights(
        self, logits: list[torch.Tensor], visible: list[torch.Tensor], log_counts: list[torch.Tensor | None]
    ) -> torch.Tensor:
        """Attention weights over consecutive segments of exact tokens and residual entries.

        Parameters
        ----------
        logits: per segment ``[..., S_i]`` float32 ``scale <q, k>`` (soft-capped if the model caps).
        visible: per segment bool broadcastable to its logits, the slots the query may attend to.
        log_counts: per segment None (exact tokens only) or float32 broadcastable to its logits:
            ``log c`` where the slot holds a residual entry, ``-inf`` where it holds an exact token.

        Returns ``[..., sum S_i]`` float32: one softmax over ``[a_M ; a_R + beta log c + log g]``
        (the paper), or with ``separate_softmax`` ``(1 - omega) softmax(a_M) + omega
        softmax(a_R + beta log c)``. Masks are applied per segment, never to a joint layout.
        """
        slots = [None if counts is None else torch.isfinite(counts) for counts in log_counts]
        exact = torch.cat([raw.masked_fill(~seen if slot is None else ~seen | slot, MASKED)
                           for raw, seen, slot in zip(logits, visible, slots)], dim=-1)
        # Residual logits are written with `where`: beta log c is -inf (or NaN for beta = 0) on exact slots.
        residual = [(start, raw, seen & slot, counts) for start, raw, seen, slot, counts
                    in zip(_offsets(logits), logits, visible, slots, log_counts) if slot is not None]
        if not residual:  # exact tokens only: the plain masked softmax
            return torch.softmax(exact, dim=-1)
        log_g = self.log_gate(exact)
        if self.separate_softmax:
            side = torch.full_like(exact, MASKED)
            members, exact_count = 0.0, (exact > MASKED).sum(dim=-1, keepdim=True)
            for start, raw, entry, counts in residual:
                side[..., start : start + raw.shape[-1]] = torch.where(entry, raw + self.beta * counts, MASKED)
                members = members + torch.where(entry, counts.exp(), 0.0).sum(dim=-1, keepdim=True)
            omega = torch.exp(log_g) * members / (members + exact_count)
            return (1.0 - omega) * torch.softmax(exact, dim=-1) + omega * torch.softmax(side, dim=-1)
        for start, raw, entry, counts in residual:
            window = exact[..., start : start + raw.shape[-1]]
            window.copy_(torch.where(entry, raw + self.beta * counts + log_g, window))
        return torch.softmax(exact, dim=-1)

    def mix(self, main: "Branch", exact_count: torch.Tensor, residual_logits: torch.Tensor,
            residual_values: torch.Tensor, log_counts: torch.Tensor) -> torch.Tensor:
        """The output ``weights`` gives, from an exact branch computed on its own (a fused
        kernel's output and log-sum-exp, ALGORITHMS.md 3.10) and the residual entries.

        main: the exact entries' ``Branch`` (output ``[..., q, d]``, lse and peak ``[..., q, 1]``);
        exact_count: ``[..., q, 1]`` visible exact entries (the separate-softmax weight needs it);
        residual_logits: ``[..., q, R]`` ``scale <q, k_mean>``; residual_values ``[..., R, d]``;
        log_counts: ``[..., 1 | q, R]`` ``log c``, ``-inf`` where no visible entry.
        """
        residual = torch.isfinite(log_counts)
        p_max = torch.where(torch.isfinite(main.lse), torch.exp(main.peak - main.lse), 0.0)
        log_g = self._gate_of(p_max) if self.gate else torch.zeros_like(p_max)
        biased = torch.where(residual, residual_logits + self.beta * log_counts, float("-inf"))
        side = Branch.of(biased, residual_values)
        if self.separate_softmax:
            members = torch.exp(log_counts).sum(dim=-1, keepdim=True)
            omega = torch.exp(log_g) * members / (members + exact_count)
            return (1.0 - omega) * main.output + omega * side.output
        return combine_by_lse(main.output, main.lse[..., 0], side.output, (side.lse + log_g)[..., 0])


def _offsets(parts: list[torch.Tensor]) -> list[int]:
    """Start of each segment along the joined last dimension."""
    starts, start = [], 0
    for part in parts:
        starts.append(start)
        start += part.shape[-1]
    return starts


class Branch(NamedTuple):
    """One separately normalised softmax: output ``[..., q, d]``, log-sum-exp and largest logit ``[..., q, 1]``."""

    output: torch.Tensor
    lse: torch.Tensor
    peak: torch.Tensor

    @classmethod
    def of(cls, logits: torch.Tensor, values: torch.Tensor, overwrite: bool = False) -> "Branch":
        """From logits ``[..., q, S]`` (``-inf`` where masked) and values ``[..., S, d]``; a query
        with nothing visible gets a zero output and ``lse = -inf``. ``overwrite``: the caller
        no longer needs ``logits``, so their memory holds the weights (no temporary as large)."""
        peak = logits.amax(dim=-1, keepdim=True)
        shift = peak.nan_to_num(neginf=0.0)
        shifted = (logits.sub_(shift) if overwrite else logits - shift).exp_()
        total = shifted.sum(dim=-1, keepdim=True)
        output = torch.matmul(shifted, values) / total.clamp(min=torch.finfo(total.dtype).tiny)
        return cls(output, peak + torch.log(total), peak)


def combine_by_lse(
    main_output: torch.Tensor, main_lse: torch.Tensor, residual_output: torch.Tensor, residual_lse: torch.Tensor
) -> torch.Tensor:
    """The shared softmax from two separately normalised branches (ALGORITHMS.md 3.10).

    main_output, residual_output: ``[..., d]`` each branch's softmax-normalised output;
    main_lse, residual_lse: ``[...]`` each branch's log-sum-exp of its logits (the residual
    one with ``beta log c + log g`` included). ``o = lam o_M + (1 - lam) o_R`` with
    ``lam = sigmoid(LSE_M - LSE_R)``; a branch with nothing to attend to (``LSE_R = -inf``:
    no entries, or ``g = 0``) leaves ``o_M`` unchanged, whatever its output holds.
    """
    lam = torch.sigmoid(main_lse - residual_lse)[..., None]
    mixed = lam * main_output + (1.0 - lam) * residual_output.nan_to_num()
    return torch.where(torch.isneginf(residual_lse)[..., None], main_output, mixed)


def capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The model's logit soft-cap (Gemma 2), applied to dot products before any bias."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap
