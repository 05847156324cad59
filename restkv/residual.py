"""ResKV (ALGORITHMS.md 3): residual entries that stand in for what eviction drops.

Per layer, row and KV head the base method's budget ``b`` is split into ``m`` exact main
slots and ``r`` residual slots (``m + r = b``). The main cache is what the base method keeps
at budget ``m`` (protected tokens + top scores); the evicted tokens ``E`` are partitioned by
Lloyd k-means on their keys into ``r`` clusters, and each cluster becomes one entry: mean
key, mean value and member count ``c``. At attention time the entries join the exact
entries in the same softmax with logit ``scale <q, k_mean> + beta log c + log g(q)``, which
restores (to first order) both the numerator and the denominator mass that eviction
removed. The gate ``g(q) = max(g_min, sigmoid(alpha (tau - p_max(q))))`` turns the residual
branch down when the query's attention over the exact entries is sharp (3.7).

The ratio ``r / b`` is chosen per layer, row and KV head by a validation proxy (3.8): the
last observation queries of the prompt are split into fit and validation queries; the
candidate ratio whose shared-softmax output best matches the full-prompt attention output
on the fit queries is kept if it beats the pure main cache on the validation queries by the
relative margin ``delta``.

Two forms of the same read-out: decode and question chunks use one softmax over the
segments (``ResidualReadout.weights``); the validation proxy normalises the exact entries on
their own and combines them with the residual entries through their log-sum-exps
(``ResidualReadout.mix``, ``combine_by_lse``, ALGORITHMS.md 3.10), the form a fused attention
kernel that returns its log-sum-exp would use. Tests hold the two equal.

Storage (``restkv.compress``, ``restkv.cache``): a head's entries take the last ``r`` of its
``b`` slots, so a layer stores exactly as many entries as the base method, plus one float32
log-count per residual slot.

Everything here is float32, per row (a row of a left-padded batch is processed exactly as
the same row alone) and batched over KV heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from restkv.config import CompressionConfig
    from restkv.policies.base import ScoringContext

#: tokens per block when assigning points to centres (bounds the distance matrix)
ASSIGN_BLOCK = 8192
#: keys per block of the full-prompt attention of the observation queries
KEY_BLOCK = 8192
#: the logit of a masked column (finite, so a row with nothing visible never yields NaN)
MASKED = torch.finfo(torch.float32).min


# ---------------------------------------------------------------- reading residual entries
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
    def from_config(cls, config: "CompressionConfig", validation: bool = False) -> "ResidualReadout":
        """The readout a config asks for; ``validation=True`` honours ``--no-residual_val_gate``."""
        gate = not config.residual_no_gate and (config.residual_val_gate or not validation)
        return cls(
            beta=float(config.residual_beta),
            gate=gate,
            tau=float(config.residual_gate_tau),
            alpha=float(config.residual_gate_alpha),
            gate_min=float(config.residual_gate_min),
            separate_softmax=config.residual_separate_softmax,
        )

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
    def of(cls, logits: torch.Tensor, values: torch.Tensor) -> "Branch":
        """From logits ``[..., q, S]`` (``-inf`` where masked) and values ``[..., S, d]``; a query
        with nothing visible gets a zero output and ``lse = -inf``."""
        peak = logits.amax(dim=-1, keepdim=True)
        shifted = torch.exp(logits - peak.nan_to_num(neginf=0.0))
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


# ---------------------------------------------------------------- k-means
class Clusters(NamedTuple):
    """Lloyd k-means result over one row's tokens, per KV head.

    assignment: ``[H, n]`` long, the cluster of each member, -1 for tokens that are not members.
    counts: ``[H, R]`` long members per cluster (0 = dropped or unused slot).
    centres: ``[H, R, d]`` float32 mean key of each cluster (meaningless where ``counts == 0``).
    """

    assignment: torch.Tensor
    counts: torch.Tensor
    centres: torch.Tensor


def lloyd_kmeans(
    points: torch.Tensor, members: torch.Tensor, init: torch.Tensor, iterations: int, empty: str = "drop"
) -> Clusters:
    """Partition the ``members`` of ``points`` around ``init`` centres (ALGORITHMS.md 3.4).

    Parameters
    ----------
    points: ``[H, n, d]`` float32 keys.
    members: ``[H, n]`` bool, the tokens to cluster (the evicted ones).
    init: ``[H, R]`` long indices of the points that seed the clusters (-1 = no cluster in this slot).
    iterations: Lloyd steps; each assigns every member to its nearest centre (squared
        Euclidean distance, ties to the lowest cluster index), then moves every centre to the
        mean of its members.
    empty: ``drop`` a cluster that loses all its members (its slot stays unused), or
        ``reseed`` it with the members farthest from their centres.

    The final clusters are those of the last assignment, so each centre is exactly the mean of
    its members.
    """
    heads, _, dim = points.shape
    active = init >= 0
    members = members & active.any(dim=-1, keepdim=True)
    centres = points.gather(1, init.clamp(min=0)[..., None].expand(heads, init.shape[1], dim))
    assignment = torch.full(members.shape, -1, dtype=torch.long, device=points.device)
    counts = torch.zeros(init.shape, dtype=torch.long, device=points.device)
    for _ in range(iterations):
        assignment, distance = _nearest_centres(points, centres, active, want_distance=empty == "reseed")
        assignment = assignment.masked_fill(~members, -1)
        if empty == "reseed":
            assignment = _reseed_empty(assignment, distance, active)
        sums, counts = cluster_sums(points, assignment, init.shape[1])
        active = active & (counts > 0)
        centres = torch.where(active[..., None], sums / counts.clamp(min=1)[..., None], centres)
    return Clusters(assignment, counts * active, centres)


def _nearest_centres(points, centres, active, want_distance: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[H, n]`` index of the nearest active centre (and the squared distance to it).

    ``|x - c|^2 = |x|^2 - 2 x.c + |c|^2``; ``|x|^2`` is the same for every centre, so the
    ranking needs only ``|c|^2 - 2 x.c`` (one fused matmul; inactive centres get ``+inf``).
    """
    centre_norms = (centres * centres).sum(dim=-1).masked_fill(~active, float("inf"))[:, None, :]
    indices, distances = [], []
    for start in range(0, points.shape[1], ASSIGN_BLOCK):
        block = points[:, start : start + ASSIGN_BLOCK]
        partial = torch.baddbmm(centre_norms, block, centres.transpose(1, 2), alpha=-2.0)
        # The first minimum: ties go to the lowest cluster index (min(dim) is faster than argmin on CPU).
        nearest = partial.min(dim=-1).indices
        indices.append(nearest)
        if want_distance:
            distances.append(partial.gather(-1, nearest[..., None])[..., 0] + (block * block).sum(dim=-1))
    return torch.cat(indices, dim=1), (torch.cat(distances, dim=1) if want_distance else None)


def _reseed_empty(assignment: torch.Tensor, distance: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Give the k-th empty active cluster (in index order) the k-th member farthest from its centre."""
    heads, length = assignment.shape
    slots = active.shape[1]
    counts = torch.zeros(active.shape, dtype=torch.long, device=assignment.device)
    counts.scatter_add_(1, assignment.clamp(min=0), (assignment >= 0).long())
    empty = active & (counts == 0)
    if not bool(empty.any()):
        return assignment
    far = distance.masked_fill(assignment < 0, float("-inf"))
    farthest = torch.sort(far, dim=-1, descending=True, stable=True).indices[:, :slots]
    donor = farthest.gather(1, (empty.long().cumsum(dim=-1) - 1).clamp(min=0, max=farthest.shape[1] - 1))
    moves = empty & torch.isfinite(far.gather(1, donor))
    # Scatter the moves into a spare last column, so heads without a move write nowhere.
    target = torch.where(moves, donor, length)
    cluster = torch.arange(slots, device=assignment.device).expand(heads, -1)
    widened = torch.cat([assignment, assignment.new_full((heads, 1), -1)], dim=1)
    return widened.scatter_(1, target, torch.where(moves, cluster, -1))[:, :length]


def cluster_sums(points: torch.Tensor, assignment: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-cluster sums ``[H, R, d]`` (float32) and member counts ``[H, R]`` of ``points`` ``[H, n, d]``."""
    heads, _, dim = points.shape
    index = assignment.masked_fill(assignment < 0, slots)  # non-members go to a spare slot
    # One flat index over (head, slot): index_add_ and bincount are several times faster on
    # CPU than scatter_add_ with an index expanded over the feature dimension.
    flat = (index + torch.arange(heads, device=points.device)[:, None] * (slots + 1)).flatten()
    sums = points.new_zeros(heads * (slots + 1), dim).index_add_(0, flat, points.reshape(-1, dim))
    counts = torch.bincount(flat, minlength=heads * (slots + 1))
    return sums.view(heads, slots + 1, dim)[:, :slots], counts.view(heads, slots + 1)[:, :slots]


# ---------------------------------------------------------------- entries
class Entries(NamedTuple):
    """Residual entries of one row, per KV head (float32).

    keys, values: ``[H, R, d]`` member means (zeros in unused slots).
    log_counts: ``[H, R]`` ``log c`` (-inf in unused slots).
    first: ``[H, R]`` long, the oldest member's position (-1 in unused slots).
    """

    keys: torch.Tensor
    values: torch.Tensor
    log_counts: torch.Tensor
    first: torch.Tensor


def entries_of(clusters: Clusters, values: torch.Tensor, positions: torch.Tensor | None = None) -> Entries:
    """Mean key, mean value, member count and oldest member of every cluster.

    values: ``[H, n, d]`` float32 of the clustered points; positions: ``[H, n]`` their token
    positions (default ``0 .. n - 1``).
    """
    heads, length, _ = values.shape
    slots = clusters.counts.shape[1]
    used = clusters.counts > 0
    value_sums, _ = cluster_sums(values, clusters.assignment, slots)
    value_means = value_sums / clusters.counts.clamp(min=1)[..., None]
    if positions is None:
        positions = torch.arange(length, device=values.device).expand(heads, -1)
    index = clusters.assignment.masked_fill(clusters.assignment < 0, slots)
    first = torch.full((heads, slots + 1), torch.iinfo(torch.long).max, dtype=torch.long, device=values.device)
    first = first.scatter_reduce(1, index, positions, reduce="amin")[:, :slots]
    log_counts = torch.where(used, clusters.counts.clamp(min=1).float().log(), float("-inf"))
    return Entries(
        torch.where(used[..., None], clusters.centres, 0.0),
        torch.where(used[..., None], value_means, 0.0),
        log_counts,
        first.masked_fill(~used, -1),
    )


# ---------------------------------------------------------------- the validation proxy
def choose_ratios(
    fit_losses: torch.Tensor, val_losses: torch.Tensor, baseline_val: torch.Tensor, delta: float,
    select_on: str = "fit",
) -> torch.Tensor:
    """Per head, the index of the chosen candidate ratio, or -1 for the pure main cache.

    fit_losses, val_losses: ``[H, C]`` losses of the ``C`` candidates (in ascending ratio
    order); baseline_val: ``[H]`` validation loss of the pure main cache (ratio 0).
    The candidate with the least fit loss (``select_on="validation"``: validation loss; ties to
    the smaller ratio) is kept if ``(L_0 - L) / L_0 >= delta`` on the validation queries.
    """
    chosen = (fit_losses if select_on == "fit" else val_losses).argmin(dim=-1)
    loss = val_losses.gather(1, chosen[:, None])[:, 0]
    improvement = (baseline_val - loss) / baseline_val
    accepted = (baseline_val > 0) & (improvement >= delta)
    return torch.where(accepted, chosen, -1)


def split_observations(count: int, validation: int, total: int, how: str) -> torch.Tensor:
    """``[count]`` bool, True for validation queries among the last ``count`` prompt queries.

    ``validation`` of ``total`` observation queries validate (scaled down for a shorter row, at
    least one, at least one left to fit). ``interleave`` spreads them evenly (every fourth
    query for 32 of 128, ending with the newest), ``last`` takes the newest, ``random:<seed>`` a
    seeded draw.
    """
    if count < 2:
        return torch.zeros(count, dtype=torch.bool)
    held_out = min(max(1, round(count * validation / total)), count - 1)
    if how == "last":
        return torch.arange(count) >= count - held_out
    if how == "interleave":
        index = torch.arange(count)
        return (index + 1) * held_out // count > index * held_out // count
    seed = int(how.split(":", 1)[1])
    chosen = torch.randperm(count, generator=torch.Generator().manual_seed(seed))[:held_out]
    return torch.zeros(count, dtype=torch.bool).index_fill_(0, chosen, True)


def full_attention_output(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, softcap: float | None,
    visible: torch.Tensor | None,
) -> torch.Tensor:
    """``[H, q, d]`` float32 attention output of ``queries`` ``[H, q, d]`` over ``keys`` ``[H, n, d]``
    (``visible``: bool broadcastable to ``[H, q, n]``, or None). The fused SDPA kernel, or with a
    logit soft-cap an online softmax streamed over key blocks (never ``q x n`` at once)."""
    if softcap is None:
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=visible, scale=scaling)
    running_max = queries.new_full(queries.shape[:2], float("-inf"))
    total = queries.new_zeros(queries.shape[:2])
    output = queries.new_zeros(queries.shape)
    for start in range(0, keys.shape[1], KEY_BLOCK):
        block = slice(start, start + KEY_BLOCK)
        logits = capped(torch.matmul(queries, keys[:, block].transpose(1, 2)) * scaling, softcap)
        if visible is not None:
            logits = logits.masked_fill(~visible[..., block], float("-inf"))
        new_max = torch.maximum(running_max, logits.amax(dim=-1))
        safe_max = new_max.masked_fill(torch.isneginf(new_max), 0.0)
        decay = torch.exp(running_max - safe_max)
        weights = torch.exp(logits - safe_max[..., None])
        total = total * decay + weights.sum(dim=-1)
        output = output * decay[..., None] + torch.matmul(weights, values[:, block])
        running_max = new_max
    return output / total[..., None]


def capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The model's logit soft-cap (Gemma 2), applied to dot products before any bias."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def ratio_sizes(ratio: float, budgets: torch.Tensor, room: torch.Tensor) -> torch.Tensor:
    """``r = floor(ratio * b)`` per head, at most ``room`` (= b - protected; 0 for heads that keep everything)."""
    sizes = torch.tensor([math.floor(round(ratio * b, 9)) for b in budgets.tolist()], device=budgets.device)
    return torch.minimum(sizes, room).clamp(min=0)


# ---------------------------------------------------------------- per layer
class ResidualPlan(NamedTuple):
    """What ``compress_kv`` needs to store a layer's residual entries.

    sizes: ``[B, H_kv]`` slots each row and head gives to residual entries (``m = b - sizes``).
    keys, values: ``[B, H_kv, R, d]`` entries, right-aligned (a head with ``r`` entries uses
        the last ``r`` slots), in the model dtype; zeros in unused slots.
    log_counts: ``[B, H_kv, R]`` float32 ``log c`` (-inf in unused slots).
    first_columns: ``[B, H_kv, R]`` long padded-batch column of each entry's oldest member (-1 unused).
    """

    sizes: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    log_counts: torch.Tensor
    first_columns: torch.Tensor


def build_residual(ctx: "ScoringContext", scores: torch.Tensor, keep: torch.Tensor) -> ResidualPlan:
    """Choose the residual size of every row and KV head and build its entries.

    scores: ``[B, H_kv, N]`` the base method's scores (selection and k-means init use them);
    keep: ``[B, H_kv]`` the base budget ``b`` per row and head, protected tokens included.
    """
    batch, num_kv_heads, length, dim = ctx.key.shape
    rows = [_row_entries(ctx, row, scores, keep[row]) for row in range(batch)]
    width = max(entries.keys.shape[1] for _, entries in rows)
    plan = ResidualPlan(
        sizes=torch.stack([sizes for sizes, _ in rows]),
        keys=ctx.key.new_zeros(batch, num_kv_heads, width, dim),
        values=ctx.value.new_zeros(batch, num_kv_heads, width, dim),
        log_counts=torch.full((batch, num_kv_heads, width), float("-inf"), device=ctx.key.device),
        first_columns=torch.full((batch, num_kv_heads, width), -1, dtype=torch.long, device=ctx.key.device),
    )
    for row, (_, entries) in enumerate(rows):
        slots = entries.keys.shape[1]
        if slots == 0:
            continue
        offset = length - int(ctx.valid[row].sum())  # row-local index -> padded column
        plan.keys[row, :, width - slots :] = entries.keys.to(ctx.key.dtype)
        plan.values[row, :, width - slots :] = entries.values.to(ctx.value.dtype)
        plan.log_counts[row, :, width - slots :] = entries.log_counts
        plan.first_columns[row, :, width - slots :] = torch.where(entries.first >= 0, entries.first + offset, -1)
    return plan


class _Row(NamedTuple):
    """One row's visible tokens (a suffix of the padded row) in the order the selection ranks
    them: protected first, then by score, ties to the lower position."""

    keys: torch.Tensor  # [H_kv, n, d] float32, ranked
    values: torch.Tensor  # [H_kv, n, d] float32, ranked
    order: torch.Tensor  # [H_kv, n] row-local position of each ranked token
    budgets: torch.Tensor  # [H_kv] b
    room: torch.Tensor  # [H_kv] slots that may become residual (b - protected; 0 if nothing is evicted)


def _row_entries(
    ctx: "ScoringContext", row: int, scores: torch.Tensor, budgets: torch.Tensor
) -> tuple[torch.Tensor, Entries]:
    """``([H_kv] residual sizes, right-aligned Entries)`` of one row."""
    config = ctx.config
    data = _rank_row(ctx, row, scores, budgets)
    ratios = (config.residual_fixed_ratio,) if config.residual_no_validation else config.residual_ratios
    sizes_of = [ratio_sizes(ratio, data.budgets, data.room) for ratio in ratios]
    built = [_cluster(data, sizes, config) if bool((sizes > 0).any()) else None for sizes in sizes_of]
    none = torch.zeros_like(data.budgets)
    if all(entries is None for entries in built):
        return none, _empty_entries(data, 0)
    if config.residual_no_validation:
        choice = torch.zeros_like(none)
    else:
        fit, val, baseline_val = _validation_losses(ctx, row, data, sizes_of, built)
        choice = choose_ratios(fit, val, baseline_val, config.residual_delta, config.residual_select_on)
    sizes = none
    for index, candidate in enumerate(sizes_of):
        sizes = torch.where(choice == index, candidate, sizes)
    width = int(sizes.max())
    chosen = _empty_entries(data, width)
    for index, entries in enumerate(built):
        picked = choice == index
        if entries is None or width == 0 or not bool(picked.any()):
            continue
        placed = _right_aligned(entries, sizes_of[index], width)
        chosen = Entries(*(torch.where(picked.view(-1, *[1] * (new.dim() - 1)), new, old)
                           for new, old in zip(placed, chosen)))
    return sizes, chosen


def _rank_row(ctx: "ScoringContext", row: int, scores: torch.Tensor, budgets: torch.Tensor) -> _Row:
    visible = int(ctx.valid[row].sum())
    start = ctx.valid.shape[-1] - visible  # visible tokens are a suffix (left padding, sliding window)
    protected = ctx.protected[row, start:]
    ranked = scores[row, :, start:].float().masked_fill(protected, float("inf"))
    # The same ranking as restkv.selection: stable, so ties go to the lower position.
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    index = order[..., None].expand(-1, -1, ctx.key.shape[-1])
    budgets = budgets.to(order.device)
    room = torch.where(budgets < visible, budgets - int(protected.sum()), 0).clamp(min=0)
    return _Row(
        ctx.key[row, :, start:].float().gather(1, index), ctx.value[row, :, start:].float().gather(1, index),
        order, budgets, room,
    )


def _cluster(data: _Row, sizes: torch.Tensor, config: "CompressionConfig") -> Entries:
    """k-means of each head's evicted tokens (ranks ``>= b - r``) into ``sizes`` clusters, seeded
    with the best-ranked evicted tokens (ranks ``b - r .. b - 1``). Works on the ranked suffix
    that holds every head's evicted tokens. Cluster ``j`` is in slot ``j``."""
    main = data.budgets - sizes
    start = int(main.min())
    slot = torch.arange(int(sizes.max()), device=sizes.device)[None, :]
    init = ((main - start)[:, None] + slot).masked_fill(slot >= sizes[:, None], -1)
    ranks = torch.arange(start, data.order.shape[1], device=sizes.device)
    members = ranks[None, :] >= main[:, None]
    clusters = lloyd_kmeans(data.keys[:, start:], members, init, config.residual_iters, config.residual_empty)
    return entries_of(clusters, data.values[:, start:], data.order[:, start:])


def _right_aligned(entries: Entries, sizes: torch.Tensor, width: int) -> Entries:
    """Entries ``width`` slots wide with head ``h``'s clusters ``0 .. sizes[h] - 1`` in its last
    ``sizes[h]`` slots (``sizes[h] <= width``); earlier slots unused."""
    source = torch.arange(width, device=sizes.device)[None, :] - (width - sizes)[:, None]
    used = source >= 0
    source = source.clamp(min=0, max=max(entries.keys.shape[1] - 1, 0))

    def move(part: torch.Tensor, fill: float) -> torch.Tensor:
        index = source if part.dim() == 2 else source[..., None].expand(-1, -1, part.shape[-1])
        mask = used if part.dim() == 2 else used[..., None]
        return torch.where(mask, part.gather(1, index), fill)

    return Entries(move(entries.keys, 0.0), move(entries.values, 0.0), move(entries.log_counts, float("-inf")),
                   move(entries.first, -1))


def _empty_entries(data: _Row, width: int) -> Entries:
    heads, dim, device = data.budgets.shape[0], data.keys.shape[-1], data.keys.device
    return Entries(
        torch.zeros(heads, width, dim, device=device),
        torch.zeros(heads, width, dim, device=device),
        torch.full((heads, width), float("-inf"), device=device),
        torch.full((heads, width), -1, dtype=torch.long, device=device),
    )


def _validation_losses(
    ctx: "ScoringContext", row: int, data: _Row, sizes_of: list[torch.Tensor], built: list[Entries | None]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fit and validation losses ``[H_kv, C]`` of every candidate ratio (``sizes_of[c]`` residual
    slots per head, entries ``built[c]``; None = no residual), and the pure main cache's
    validation loss ``[H_kv]`` (ALGORITHMS.md 3.8).

    The candidates' main caches are prefixes of the ranked tokens, so one matmul gives every
    main logit; each candidate's output is its exact branch (the prefix) combined with its
    residual branch through their log-sum-exps (``ResidualReadout.mix``).
    """
    config = ctx.config
    num_kv_heads, visible, dim = data.keys.shape
    length = ctx.query.shape[2]
    count = min(config.residual_obs_queries, visible)
    groups = ctx.query.shape[1] // num_kv_heads
    queries = ctx.query[row, :, length - count :].float().reshape(num_kv_heads, groups * count, dim)
    held_out = split_observations(count, config.residual_val_queries, config.residual_obs_queries,
                                  config.residual_val_split).to(queries.device)
    fit_rows = ~held_out
    if not bool(held_out.any()):  # a single observation query both fits and validates
        held_out = fit_rows
    # Probe semantics (every query sees every visible key), or causal with --residual_val_causal.
    causal = None
    if config.residual_val_causal:
        query_positions = torch.arange(visible - count, visible, device=queries.device).repeat(groups)
        causal = data.order[:, None, :] <= query_positions[None, :, None]  # [H_kv, G * count, n], ranked
    target = full_attention_output(queries, data.keys, data.values, ctx.scaling, ctx.softcap, causal)

    widest = int(data.budgets.max())
    main_logits = capped(torch.matmul(queries, data.keys[:, :widest].transpose(1, 2)) * ctx.scaling, ctx.softcap)
    main_visible = torch.ones_like(main_logits, dtype=torch.bool) if causal is None else causal[..., :widest]
    readout = ResidualReadout.from_config(config, validation=True)
    rank = torch.arange(widest, device=queries.device)

    def losses(sizes: torch.Tensor, entries: Entries | None) -> tuple[torch.Tensor, torch.Tensor]:
        exact = main_visible & (rank < (data.budgets - sizes)[:, None])[:, None, :]
        main = Branch.of(main_logits.masked_fill(~exact, float("-inf")), data.values[:, :widest])
        output = main.output
        if entries is not None:
            residual_logits = capped(torch.matmul(queries, entries.keys.transpose(1, 2)) * ctx.scaling, ctx.softcap)
            output = readout.mix(main, exact.sum(dim=-1, keepdim=True), residual_logits, entries.values,
                                 entries.log_counts[:, None, :])
        error = ((output - target) ** 2).sum(dim=-1).view(num_kv_heads, groups, count)
        return error[:, :, fit_rows].mean(dim=(1, 2)), error[:, :, held_out].mean(dim=(1, 2))

    baseline = losses(torch.zeros_like(data.budgets), None)
    scored = [baseline if entries is None else losses(sizes, entries) for sizes, entries in zip(sizes_of, built)]
    return torch.stack([fit for fit, _ in scored], dim=1), torch.stack([val for _, val in scored], dim=1), baseline[1]
