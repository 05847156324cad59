"""ResKV's construction-time validation proxy, which picks each head's residual ratio.

The last observation queries of the prompt are split into fit and validation queries; the
candidate ratio whose shared-softmax output best matches the full-prompt attention output
on the fit queries is kept if it beats the pure main cache on the validation queries by the
relative margin ``delta``. The numbers (128 queries, 32 of them validating, ``delta`` 0.01) are
the paper's; which queries validate and the two-step choice are ours (the paper does not say).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from restkv.cache.partial import Partial, Probe, merge, sdpa_kernel, softmax_partial
from restkv.cache.segments.residual_entries import capped
from restkv.switches.residual.clustering import Entries, RankedRow, ResidualOptions

if TYPE_CHECKING:
    from restkv.pipeline.inputs import LayerInputs

#: most keys in one segment of the observation queries' attention (bounds their logits)
KEY_BLOCK = 8192


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


class KeySegments(NamedTuple):
    """The attention of some queries over consecutive segments of their keys, each segment read
    as its own partial (``restkv.cache.partial``), stacked: outputs ``[S, H, q, d]``, log-sum-exps,
    peaks and visible key counts ``[S, H, q]``, and the end column of each segment ``[S]``.

    Any union of segments is then one log-sum-exp merge away (``joined``): the validation proxy
    reads the full-prompt target and every candidate's main cache (prefixes of the ranked keys)
    from one pass over the keys.
    """

    outputs: torch.Tensor
    lse: torch.Tensor
    peaks: torch.Tensor
    counts: torch.Tensor
    ends: torch.Tensor

    @classmethod
    def of(cls, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
           softcap: float | None, visible: torch.Tensor | None, cuts: list[int]) -> "KeySegments":
        """Segments ``[cuts[i], cuts[i + 1])`` of ``keys``/``values`` ``[H, n, d]`` seen by
        ``queries`` ``[H, q, d]`` (``visible``: bool broadcastable to ``[H, q, n]``, or None)."""
        parts, counts = [], []
        for start, stop in zip(cuts[:-1], cuts[1:]):
            # The scale is applied inside the product (one pass over the logits, not two).
            logits = torch.baddbmm(queries.new_empty(()), queries, keys[:, start:stop].transpose(1, 2), beta=0.0,
                                   alpha=scaling)
            logits = capped(logits, softcap)
            if visible is None:
                counts.append(torch.full(logits.shape[:-1], stop - start, device=logits.device))
            else:
                seen = visible[..., start:stop].expand_as(logits)
                logits.masked_fill_(~seen, float("-inf"))
                counts.append(seen.sum(dim=-1))
            parts.append(softmax_partial(logits, values[:, start:stop]))
        outputs, lse, peaks = (torch.stack([part[field] for part in parts]) for field in range(3))
        return cls(outputs, lse, peaks, torch.stack(counts), torch.tensor(cuts[1:], device=queries.device))

    def joined(self, prefix: torch.Tensor | None = None) -> Partial:
        """The partial of the segments that end within each head's first ``prefix`` ``[H]`` keys
        (None: all of them), with its visible key counts ``[H, q]``."""
        if prefix is None:
            included = torch.ones(self.ends.shape[0], 1, dtype=torch.bool, device=self.ends.device)
        else:
            included = self.ends[:, None] <= prefix[None, :]  # [S, H]
        included = included[..., None]
        lse_parts = torch.where(included, self.lse, float("-inf"))
        lse = torch.logsumexp(lse_parts, dim=0)
        weights = torch.exp(lse_parts - lse.nan_to_num(neginf=0.0))[..., None]  # 0 where nothing is visible
        output = (weights * self.outputs).sum(dim=0)
        peak = torch.where(included, self.peaks, float("-inf")).amax(dim=0)
        return Partial(output, lse, peak, (self.counts * included).sum(dim=0))


def segment_cuts(length: int, ends: list[int]) -> list[int]:
    """Segment bounds over ``length`` keys: every given prefix end, and at most ``KEY_BLOCK``
    keys a segment (bounding the ``q x segment`` logits)."""
    return sorted({0, length, *(end for end in ends if 0 < end < length), *range(KEY_BLOCK, length, KEY_BLOCK)})


def unranked_partial(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                     softcap: float | None, visible: torch.Tensor | None) -> Partial:
    """Output and log-sum-exp of ``queries`` ``[H, q, d]`` over keys no candidate's main cache holds
    (the evicted ones, which only the full-prompt target reads): no peak and no count are needed, so on
    the CPU the fused kernel reads them in one call; elsewhere, and for soft-capped logits, ``KEY_BLOCK``
    blocks."""
    if queries.device.type != "cpu" or softcap is not None or keys.shape[-1] != values.shape[-1]:
        return KeySegments.of(queries, keys, values, scaling, softcap, visible,
                              segment_cuts(keys.shape[1], [])).joined()
    probe = Probe(queries[None], queries.shape[0], 0, scaling, need_lse=True)
    part = sdpa_kernel(probe, keys[None], values[None], None if visible is None else visible[None])
    lse = part.lse[0]
    return Partial(torch.where(torch.isfinite(lse)[..., None], part.output[0].float(), 0.0), lse)


def full_attention_output(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, softcap: float | None,
    visible: torch.Tensor | None,
) -> torch.Tensor:
    """``[H, q, d]`` float32 attention output of ``queries`` ``[H, q, d]`` over ``keys`` ``[H, n, d]``
    (``visible``: bool broadcastable to ``[H, q, n]``, or None), softcapped logits included; the
    keys are read in blocks, never ``q x n`` logits at once."""
    segments = KeySegments.of(queries, keys, values, scaling, softcap, visible, segment_cuts(keys.shape[1], []))
    return segments.joined().output


def validation_losses(
    options: "ResidualOptions", ctx: "LayerInputs", row: int, data: RankedRow, sizes_of: list[torch.Tensor],
    built: list[Entries | None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fit and validation losses ``[H_kv, C]`` of every candidate ratio (``sizes_of[c]`` residual
    slots per head, entries ``built[c]``; None = no residual), and the pure main cache's
    validation loss ``[H_kv]``.

    The candidates' main caches are prefixes of the ranked tokens, so one pass over the keys,
    cut at every candidate's prefix end (``KeySegments``), gives the full-prompt target and
    every main branch; each candidate's output is its main partial with its entries read in
    (``ResidualReadout.join``, the read-out of decode steps). The joins equal one softmax over
    the same keys up to float32 rounding (losses within about 1e-7 relative).
    """
    num_kv_heads, visible, dim = data.keys.shape
    observation = ctx.observation
    count = min(options.residual_obs_queries, visible, observation.query_count)
    groups = ctx.query.shape[1] // num_kv_heads
    queries = observation.queries(row, count).float().reshape(num_kv_heads, groups * count, dim)
    held_out = split_observations(count, options.residual_val_queries, options.residual_obs_queries,
                                  options.residual_val_split).to(queries.device)
    fit_rows = ~held_out
    if not bool(held_out.any()):  # a single observation query both fits and validates
        held_out = fit_rows
    # Probe semantics (every query sees every visible key), or causal with --residual_val_causal
    # (the same for queries that come after the whole prompt, such as reconstruction queries).
    causal = None
    if options.residual_val_causal and not observation.sees_everything:
        query_positions = torch.arange(visible - count, visible, device=queries.device).repeat(groups)
        causal = data.order[:, None, :] <= query_positions[None, :, None]  # [H_kv, G * count, n], ranked
    mains = [data.budgets - sizes for sizes in sizes_of]
    ends = sorted({end for main in [data.budgets, *mains] for end in main.tolist()})
    ranked = max(ends)  # every main cache lies within the first `ranked` keys; the rest only in the target
    segments = KeySegments.of(queries, data.keys[:, :ranked], data.values[:, :ranked], ctx.scaling, ctx.softcap,
                              None if causal is None else causal[..., :ranked], segment_cuts(ranked, ends))
    target = segments.joined()
    if ranked < visible:
        rest = unranked_partial(queries, data.keys[:, ranked:], data.values[:, ranked:], ctx.scaling, ctx.softcap,
                                None if causal is None else causal[..., ranked:])
        target = merge([target, rest], statistics=False)
    target = target.output
    readout = options.readout(validation=True)

    def losses(main_size: torch.Tensor, entries: Entries | None) -> tuple[torch.Tensor, torch.Tensor]:
        main = segments.joined(main_size)
        output = main.output
        if entries is not None:
            residual_logits = capped(torch.matmul(queries, entries.keys.transpose(1, 2)) * ctx.scaling, ctx.softcap)
            output = readout.join(main, main, residual_logits, entries.values,
                                  entries.log_counts[:, None, :]).output
        error = ((output - target) ** 2).sum(dim=-1).view(num_kv_heads, groups, count)
        return error[:, :, fit_rows].mean(dim=(1, 2)), error[:, :, held_out].mean(dim=(1, 2))

    baseline = losses(data.budgets, None)
    scored = [baseline if entries is None else losses(main, entries) for main, entries in zip(mains, built)]
    return torch.stack([fit for fit, _ in scored], dim=1), torch.stack([val for _, val in scored], dim=1), baseline[1]
