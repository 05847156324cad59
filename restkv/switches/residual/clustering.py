"""Lloyd k-means of evicted keys and the residual entries made from the clusters (ResKV).

Everything is float32 and batched over KV heads: each head clusters its own evicted tokens.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

#: tokens per block when assigning points to centres (bounds the distance matrix)
ASSIGN_BLOCK = 8192


#: the ``--residual`` part's options (``restkv.switches.residual.options.ResidualCache``), as the builder and
#: the validation proxy read them
ResidualOptions = Any


class RankedRow(NamedTuple):
    """One row's visible tokens (a suffix of the padded row) in the order the selection ranks
    them: protected first, then by score, ties to the lower position."""

    keys: torch.Tensor  # [H_kv, n, d] float32, ranked
    values: torch.Tensor  # [H_kv, n, d] float32, ranked
    order: torch.Tensor  # [H_kv, n] position of each ranked token in the visible suffix
    budgets: torch.Tensor  # [H_kv] b
    room: torch.Tensor  # [H_kv] slots that may become residual (b - protected; 0 if nothing is evicted)


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
    points: torch.Tensor, members: torch.Tensor, init: torch.Tensor, iterations: int, empty: str = "drop",
    weights: torch.Tensor | None = None,
) -> Clusters:
    """Partition the ``members`` of ``points`` around ``init`` centres (Lloyd's algorithm).

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
    weights: optional ``[H, n]`` float weight of each point (centres are weighted means and
        ``counts`` the total weight per cluster, float32).

    The final clusters are those of the last assignment, so each centre is exactly the mean of
    its members. An assignment equal to the previous one is a fixed point, so the steps left
    are skipped: they would repeat it exactly.
    """
    heads, _, dim = points.shape
    points = points.contiguous()  # one copy here, not one per step (cluster_sums flattens it)
    active = init >= 0
    members = members & active.any(dim=-1, keepdim=True)
    centres = points.gather(1, init.clamp(min=0)[..., None].expand(heads, init.shape[1], dim))
    assignment = torch.full(members.shape, -1, dtype=torch.long, device=points.device)
    counts = torch.zeros(init.shape, dtype=torch.long, device=points.device)
    for _ in range(iterations):
        previous = assignment
        assignment, distance = _nearest_centres(points, centres, active, want_distance=empty == "reseed")
        assignment = assignment.masked_fill(~members, -1)
        if empty == "reseed":
            assignment = _reseed_empty(assignment, distance, active)
        if torch.equal(assignment, previous):  # a fixed point: every further step would repeat this one
            break
        sums, counts = cluster_sums(points, assignment, init.shape[1], weights)
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
        nearest = _first_minimum(partial)
        indices.append(nearest)
        if want_distance:
            distances.append(partial.gather(-1, nearest[..., None])[..., 0] + (block * block).sum(dim=-1))
    return torch.cat(indices, dim=1), (torch.cat(distances, dim=1) if want_distance else None)


def _first_minimum(distances: torch.Tensor) -> torch.Tensor:
    """Index of the first smallest entry along the last dimension (ties to the lowest cluster
    index; NaN ranks first, as ``min`` ranks it). On the CPU NumPy's vectorised ``argmin`` runs
    two to three times faster than ``min(dim)`` over rows of a few dozen centres, and picks the
    same index."""
    if distances.device.type == "cpu":
        return torch.from_numpy(np.argmin(distances.detach().numpy(), axis=-1))
    return distances.min(dim=-1).indices


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


def cluster_sums(points: torch.Tensor, assignment: torch.Tensor, slots: int,
                 weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-cluster sums ``[H, R, d]`` (float32) and member counts ``[H, R]`` of ``points`` ``[H, n, d]``;
    with ``weights`` ``[H, n]`` the weighted sums and the total weight per cluster (float32)."""
    heads, _, dim = points.shape
    index = assignment.masked_fill(assignment < 0, slots)  # non-members go to a spare slot
    # One flat index over (head, slot): index_add_ and bincount are several times faster on
    # CPU than scatter_add_ with an index expanded over the feature dimension.
    flat = (index + torch.arange(heads, device=points.device)[:, None] * (slots + 1)).flatten()
    weighted = points if weights is None else points * weights[..., None]
    sums = points.new_zeros(heads * (slots + 1), dim).index_add_(0, flat, weighted.reshape(-1, dim))
    counts = torch.bincount(flat, weights=None if weights is None else weights.flatten(), minlength=heads * (slots + 1))
    return sums.view(heads, slots + 1, dim)[:, :slots], counts.view(heads, slots + 1)[:, :slots]


def fold_into_entries(entry_keys: torch.Tensor, entry_values: torch.Tensor, entry_counts: torch.Tensor,
                      keys: torch.Tensor, values: torch.Tensor, iterations: int) -> tuple[torch.Tensor, ...]:
    """Residual entries ``[r, d]`` (member counts ``[r]``, all > 0) after newly evicted tokens
    ``[m, d]`` join them: weighted Lloyd k-means over the entries (each weighing its member
    count) and the new tokens (weight 1), seeded with the entries. Every entry stays the mean
    of all its members, old and new; an entry that loses every member is dropped.

    Returns ``(keys, values, counts)`` of the surviving entries (float32, in slot order).
    """
    points = torch.cat([entry_keys.float(), keys.float()])[None]
    point_values = torch.cat([entry_values.float(), values.float()])[None]
    weights = torch.cat([entry_counts.float(), keys.new_ones(keys.shape[0], dtype=torch.float32)])[None]
    slots = entry_keys.shape[0]
    members = torch.ones(points.shape[:2], dtype=torch.bool, device=points.device)
    seeds = torch.arange(slots, device=points.device)[None]  # the old entries are the first points
    clusters = lloyd_kmeans(points, members, seeds, iterations, weights=weights)
    value_sums, mass = cluster_sums(point_values, clusters.assignment, slots, weights)
    used = clusters.counts[0] > 0
    return clusters.centres[0, used], (value_sums[0] / mass[0].clamp(min=1)[:, None])[used], clusters.counts[0, used]


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
