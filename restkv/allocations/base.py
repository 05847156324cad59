"""The base of the allocations: how a row's budget is spread over a layer's KV heads, and the rounding
the allocations that spread one total over many heads share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from restkv.config.options import Options
from restkv.pipeline.inputs import LayerInputs
from restkv.pipeline.plan import LayerShape, RowShape


@dataclass(frozen=True)
class Allocation(Options):
    """Base of the allocations: spreads each row's budget over the KV heads of a layer.

    An allocation with ``model_wide = True`` needs every layer's scores at once: its layers
    compress after the whole prefill (``restkv.integrations.transformers.deferred``), which calls ``allocate_model``.
    """

    model_wide: ClassVar[bool] = False
    #: spreads a row's budget unequally over the KV heads of a layer (AdaKV, HeadKV): heads
    #: compressed apart (``restkv.pipeline.recompress``) then share one row budget
    head_adaptive: ClassVar[bool] = False
    #: a boolean option of the allocation that also selects it (the release's ``--use_pyramid``)
    selected_by: ClassVar[str | None] = None
    #: may keep every token of a layer, or of some of its KV heads, by design under a budget that
    #: compresses the prompt (DuoAttention's retrieval heads, SimLayerKV's layers that are not lazy, a
    #: LU-KV curve's unpruned heads): a check that a compressing prefill compressed (the runners') can
    #: then ask only that restkv built the layers
    may_keep_whole: ClassVar[bool] = False

    def layer_budget(self, budget: int, seen: int, layer_idx: int, num_layers: int) -> int:
        """The tokens per KV head layer ``layer_idx`` keeps of a row whose budget is ``budget`` (window
        included) and which has seen ``seen`` tokens (the prompt so far, and the generated ones): the
        budget, unless the allocation sets each layer's own (``per_layer``). ``restkv.pipeline.plan.plan_layer``
        reads it, so that whether a layer is compressed at all follows the layer's budget."""
        return budget

    def allocate(self, ctx: LayerInputs, scores: torch.Tensor) -> torch.Tensor:
        """``[B, H_kv]`` tokens kept per row and KV head, protected tokens included."""
        protected = ctx.protected.sum(dim=-1)
        rows = []
        sizes = zip(ctx.budgets.tolist(), protected.tolist(), ctx.plan.visible_counts.tolist())
        for row, (budget, window, length) in enumerate(sizes):
            shape = RowShape(row, budget, window, length)
            if shape.candidate_budget >= shape.candidates:  # the row fits: keep every visible token
                rows.append(torch.full((ctx.num_kv_heads,), shape.candidates, dtype=torch.long))
            else:
                available = torch.full((ctx.num_kv_heads,), shape.candidates, dtype=torch.long)
                rows.append(self.candidate_counts(ctx.shape, scores[row][:, ctx.candidates[row]], shape,
                                                  available).cpu())
        return torch.stack(rows).to(ctx.budgets.device) + protected[:, None]

    def candidate_counts(self, layer: LayerShape, scores: torch.Tensor, shape: RowShape,
                         available: torch.Tensor) -> torch.Tensor:
        """``[H_kv]`` candidate (non-protected) counts of a row that must be compressed.

        scores: ``[H_kv, n]`` the row's candidate scores per head; available: ``[H_kv]`` how many
        candidates each head has (when heads differ, as after an earlier compression, a head's
        row ends with ``-inf``); no count may exceed its head's. ``shape.candidate_budget`` is
        the average share (``B = C - W``).
        """
        raise NotImplementedError

    def allocate_model(self, contexts: dict[int, LayerInputs],
                       scores: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Model-wide allocations: ``{layer: [B, H_kv] kept counts}`` from every compressed layer's
        context and scores (protected tokens included)."""
        raise NotImplementedError


def clamp_spreading_excess(ideal: torch.Tensor, weights: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamp ``ideal`` at ``limit`` and give what was cut to the unclamped entries, in
    proportion to ``weights`` (uniformly if they are all zero), until nothing exceeds it."""
    values = ideal.clone()
    while bool((values > limit).any()):
        excess = float((values - limit).clamp(min=0).sum())
        values = values.clamp(max=limit)
        free = values < limit
        if not bool(free.any()):
            break
        share = torch.where(free, weights, torch.zeros_like(weights))
        share = share / share.sum() if float(share.sum()) > 0 else free.double() / float(free.sum())
        values = values + excess * share
    return values


def round_to_total(values: torch.Tensor, total: int, limit: int) -> torch.Tensor:
    """Integers near ``values`` that sum to ``total`` (largest remainder; ties to the lower
    index), none above ``limit``."""
    counts = values.floor().long().clamp(max=limit)
    missing = min(total - int(counts.sum()), int((counts < limit).sum()))
    if missing > 0:
        # Remainders equal up to float noise count as ties (so the lower index wins, predictably).
        remainders = (values - counts.double()).round(decimals=9)
        remainders = torch.where(counts < limit, remainders, torch.full_like(values, -1.0))
        order = torch.sort(remainders, descending=True, stable=True).indices[:missing]
        counts[order] += 1
    return counts
