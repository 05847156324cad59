"""The construction-time validation proxy that picks each head's residual ratio (ALGORITHMS.md 3.8).

The last observation queries of the prompt are split into fit and validation queries; the
candidate ratio whose shared-softmax output best matches the full-prompt attention output
on the fit queries is kept if it beats the pure main cache on the validation queries by the
relative margin ``delta``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from restkv.residual.clustering import Entries
from restkv.residual.readout import Branch, capped

if TYPE_CHECKING:
    from restkv.context import ScoringContext
    from restkv.residual.builder import RankedRow
    from restkv.residual.options import ResidualCache

#: keys per block of the full-prompt attention of the observation queries
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


def validation_losses(
    options: "ResidualCache", ctx: "ScoringContext", row: int, data: "RankedRow", sizes_of: list[torch.Tensor],
    built: list[Entries | None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fit and validation losses ``[H_kv, C]`` of every candidate ratio (``sizes_of[c]`` residual
    slots per head, entries ``built[c]``; None = no residual), and the pure main cache's
    validation loss ``[H_kv]`` (ALGORITHMS.md 3.8).

    The candidates' main caches are prefixes of the ranked tokens, so one matmul gives every
    main logit; each candidate's output is its exact branch (the prefix) combined with its
    residual branch through their log-sum-exps (``ResidualReadout.mix``).
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
    target = full_attention_output(queries, data.keys, data.values, ctx.scaling, ctx.softcap, causal)

    widest = int(data.budgets.max())
    main_logits = capped(torch.matmul(queries, data.keys[:, :widest].transpose(1, 2)) * ctx.scaling, ctx.softcap)
    main_visible = torch.ones_like(main_logits, dtype=torch.bool) if causal is None else causal[..., :widest]
    readout = options.readout(validation=True)
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
