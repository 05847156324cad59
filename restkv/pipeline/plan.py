"""One layer's prefill plan.

``plan_layer`` decides once per layer what the compressing prefill does: which tokens are
real, which ones the next query can still see (a sliding-window layer forgets older
ones), each row's budget, the protected tokens, and whether anything is evicted at all.
The attention forward, ``compress_kv`` and the benchmark runners' "did every layer
compress" check all read the same plan.

Positions: every tensor here indexes the padded batch (prompts are left-padded; column
``j`` of row ``b`` is real iff ``valid[b, j]``). Only the notebook-facing return of
``restkv.compress_kv`` converts them to row-local positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from restkv.config.options import ConfigError


@dataclass(frozen=True)
class LayerPlan:
    """What one layer's compressing prefill does (see the module docstring).

    valid: ``[B, N]`` bool, real tokens.
    visible: ``[B, N]`` bool, real tokens the next query can still attend to (all of them, or
        on a sliding-window layer the last ``sliding_window - 1``): the tokens that compete.
    budgets: ``[B]`` tokens each row keeps per KV head (window included, at most its visible tokens).
    protected: ``[B, N]`` bool, tokens kept whatever their score (the recent window).
    compress: whether any row holds more visible tokens than its budget (else the layer is
        stored as it is).
    shared_heads: every KV head keeps the same tokens (their scores averaged, the smallest head's
        count), for a module that reads each head's values from other heads (DiffLlama).
    """

    valid: torch.Tensor
    visible: torch.Tensor
    budgets: torch.Tensor
    protected: torch.Tensor
    compress: bool
    layer_idx: int
    num_layers: int
    window_size: int
    seed: int
    sliding_window: int | None = None
    shared_heads: bool = False

    @property
    def lengths(self) -> torch.Tensor:
        """``[B]`` real tokens per row."""
        return self.valid.sum(dim=-1)

    @property
    def visible_counts(self) -> torch.Tensor:
        """``[B]`` visible tokens per row."""
        return self.visible.sum(dim=-1)

    @property
    def candidates(self) -> torch.Tensor:
        """``[B, N]`` bool, tokens that compete for the budget (visible and not protected)."""
        return self.visible & ~self.protected

    @property
    def padding(self) -> torch.Tensor:
        """``[B]`` left-padding columns of each row (padded column = row-local position + padding)."""
        return self.valid.shape[-1] - self.lengths


def plan_layer(config: Any, valid: torch.Tensor, layer_idx: int = 0, num_layers: int = 1,
               sliding_window: int | None = None, budgets: list[int] | None = None,
               context_span: tuple[int, int] | None = None, seen: list[int] | None = None) -> LayerPlan:
    """The prefill plan of layer ``layer_idx`` for a left-padded prompt with real tokens ``valid``.

    ``config`` is a ``restkv.config.CompressionConfig``; ``budgets`` overrides its budget of
    each row (a layer compressed again keeps the budget of all the tokens it has seen);
    ``context_span``: the row-local ``(start, stop)`` of the context, every token outside it
    protected too (``restkv.integrations.transformers.context_span``); ``seen``: the tokens each row has seen, where the
    layer holds fewer (a recompression; default: its visible tokens), which a layer's own budget counts
    (``layer_budgets``). Raises ``ConfigError`` when a row that must be compressed cannot keep more
    than its protected tokens (a ratio budget on a short row).
    """
    if not 0 <= layer_idx < num_layers:
        raise ValueError(f"layer_idx {layer_idx} must lie in 0..{num_layers - 1} (num_layers {num_layers})")
    policy = config.policy
    visible = valid
    length = valid.shape[-1]
    if sliding_window is not None:
        visible = valid & (torch.arange(length, device=valid.device) >= length - sliding_window + 1)
    # One host transfer for every row's sizes.
    lengths, counts = valid.sum(dim=-1).tolist(), visible.sum(dim=-1).tolist()
    wanted = budgets if budgets is not None else [config.budget_for(int(n)) for n in lengths]
    budgets = [min(int(b), int(c)) for b, c in zip(wanted, counts)]
    window = config.run.window_size
    protected_counts = [policy.protected_count(window, budget) for budget in budgets]
    layered = layer_budgets(config, budgets, seen or counts, layer_idx, num_layers)
    compress = policy.evicts and policy.compresses_layer(layer_idx) and any(
        budget < count for budget, count in zip(layered, counts)
    )
    if compress:
        for count, budget, protected in zip(counts, budgets, protected_counts):
            if count > budget:
                policy.check_row(config, count, budget, protected)
    budgets = layered
    start = torch.tensor([length - c for c in protected_counts], device=valid.device)
    protected = (torch.arange(length, device=valid.device)[None, :] >= start[:, None]) & visible
    if context_span is not None:
        protected = protected | _around(valid, visible, context_span)
        if compress:
            for count, budget, around in zip(counts, budgets, protected.sum(dim=-1).tolist()):
                if count > budget and around >= budget:
                    raise ConfigError(
                        f"the {around} protected tokens (the template around context_span {tuple(context_span)} "
                        f"and the window) fill the budget of {budget}: raise the budget")
    return LayerPlan(valid, visible, torch.tensor(budgets, device=valid.device), protected, compress,
                     layer_idx, num_layers, window, config.run.seed, sliding_window)


def layer_budgets(config: Any, budgets: list[int], seen: list[int], layer_idx: int, num_layers: int) -> list[int]:
    """Each row's budget on layer ``layer_idx``: the allocation's for the layer (``Allocation.layer_budget``:
    ``--allocation per_layer``'s ratio of the ``seen`` tokens) within the run's ``budgets``, never below
    the row's protected tokens (they stay whatever the ratio)."""
    window = config.run.window_size
    return [min(budget, max(config.allocator.layer_budget(budget, int(count), layer_idx, num_layers),
                            config.policy.protected_count(window, budget)))
            for budget, count in zip(budgets, seen)]


def _around(valid: torch.Tensor, visible: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    """``[B, N]`` bool: the visible tokens outside each row's context ``span`` (row-local)."""
    length = valid.shape[-1]
    local = torch.arange(length, device=valid.device)[None, :] - (length - valid.sum(dim=-1))[:, None]
    return visible & ((local < span[0]) | (local >= span[1]))


def valid_from_mask(attention_mask: torch.Tensor | None, batch: int, length: int, device,
                    empty_rows: bool = False) -> torch.Tensor:
    """``[B, N]`` bool real-token mask from an optional 2-D 0/1 mask; checks left padding (and
    that every row holds a real token, unless ``empty_rows``)."""
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    if attention_mask.shape != (batch, length):
        raise ValueError(f"attention_mask must have shape [B, N] = [{batch}, {length}], got {list(attention_mask.shape)}")
    valid = attention_mask.to(device=device).bool()
    # Left padding: once a row has a real token, every later column is real.
    if bool((valid[:, :-1] & ~valid[:, 1:]).any()):
        raise ValueError(
            "restkv expects left padding (tokenizer.padding_side = 'left'); the attention mask has padding "
            "after a real token"
        )
    if not empty_rows and not bool(valid.any(dim=-1).all()):
        raise ValueError("a row of the batch is all padding; every row needs at least one real token")
    return valid


class LayerShape(NamedTuple):
    """Where a layer sits and how many heads it has (what allocations read besides the scores)."""

    layer_idx: int
    num_layers: int
    num_heads: int
    num_kv_heads: int


class RowShape(NamedTuple):
    """One row's budget: ``budget`` = C tokens per head (window included), ``window`` = W
    protected tokens, ``length`` = L visible tokens (of its longest head, when heads differ)."""

    row: int
    budget: int
    window: int
    length: int

    @property
    def candidate_budget(self) -> int:
        """``B = C - W``."""
        return self.budget - self.window

    @property
    def candidates(self) -> int:
        """``L - W`` tokens that compete."""
        return self.length - self.window
