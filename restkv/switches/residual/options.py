"""The ResKV switch (``--residual``) and its options.

``--residual`` turns the part on for any scorer whose ranking can be split (not
StreamingLLM's positions, not a method that already merges evicted tokens); every number of
the method has its own flag. The defaults are the paper's (its appendix B.3); where it is silent
(which queries validate, the ratio without validation, empty clusters) they are ours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.cache.segments.residual_entries import ResidualEntries, ResidualReadout
from restkv.config.options import ConfigError, Options, option, register
from restkv.scoring.selection import Reservation
from restkv.switches.residual.builder import ResidualPlan, build_residual
from restkv.switches.residual.clustering import fold_into_entries

RESIDUAL_SELECT_ON = ("fit", "validation")
RESIDUAL_EMPTY = ("drop", "reseed")


@register("switch")
@dataclass(frozen=True)
class ResidualCache(Options):
    """ResKV: part of each budget goes to residual entries (k-means summaries of the evicted tokens)."""

    name = "residual"
    reference = "ResKV: Zhan, Chen and Shang, arXiv 2607.29591"
    switch_help = "ResKV: give part of each budget to residual entries (k-means summaries of the evicted tokens)"

    residual_ratios: tuple[float, ...] = option(
        (0.0, 0.05, 0.10, 0.15, 0.20), "ResKV: candidate fractions of each budget given to residual entries"
    )
    residual_obs_queries: int = option(128, "ResKV validation: observation queries (the last prompt positions)",
                                       minimum=2)
    residual_val_queries: int = option(32, "ResKV validation: how many of the observation queries validate",
                                       minimum=1)
    residual_val_split: str = option(
        "interleave", "ResKV validation: which observation queries validate: interleave, last or random:<seed>"
    )
    residual_val_causal: bool = option(
        False, "ResKV validation: each observation query sees only the keys before it (default: every key)"
    )
    residual_val_gate: bool = option(True, "ResKV validation: include the dynamic gate in the validated output")
    residual_select_on: str = option(
        "fit", "ResKV validation: choose the ratio on the fit queries (then accept on validation) or on validation",
        RESIDUAL_SELECT_ON,
    )
    residual_delta: float = option(
        0.01, "ResKV validation: least relative improvement over the pure main cache to keep residual entries",
        minimum=0,
    )
    residual_no_validation: bool = option(False, "ResKV ablation: --residual_fixed_ratio for every layer and head")
    residual_fixed_ratio: float = option(0.10, "ResKV: the ratio used with --residual_no_validation")
    residual_iters: int = option(4, "ResKV: Lloyd k-means iterations", minimum=1)
    residual_empty: str = option(
        "drop", "ResKV: a k-means cluster that loses its members is dropped or reseeded", RESIDUAL_EMPTY
    )
    residual_beta: float = option(1.0, "ResKV: exponent of the member count in the residual logit (beta log c)",
                                  minimum=0)
    residual_gate_tau: float = option(0.25, "ResKV gate: main-cache attention peak at which the gate is 1/2")
    residual_gate_alpha: float = option(12.0, "ResKV gate: slope (1 / temperature)", minimum=0,
                                        exclusive_minimum=True)
    residual_gate_min: float = option(0.0, "ResKV gate: floor", minimum=0, maximum=1)
    residual_no_gate: bool = option(False, "ResKV ablation: no dynamic gate (g = 1)")
    residual_separate_softmax: bool = option(
        False, "ResKV ablation: normalise main and residual entries apart and mix the two outputs"
    )

    def validate(self) -> None:
        ratios = self.residual_ratios
        if not ratios or not all(0.0 <= r < 1.0 for r in ratios):
            raise ConfigError(f"--residual_ratios must be one or more fractions in [0, 1); got {ratios!r}")
        object.__setattr__(self, "residual_ratios", tuple(sorted({float(r) for r in ratios})))
        if not 0.0 <= self.residual_fixed_ratio < 1.0:
            raise ConfigError(f"--residual_fixed_ratio must be a fraction in [0, 1); got {self.residual_fixed_ratio!r}")
        if self.residual_val_queries >= self.residual_obs_queries:
            raise ConfigError(
                f"--residual_val_queries ({self.residual_val_queries}) must be smaller than --residual_obs_queries "
                f"({self.residual_obs_queries}): some observation queries must remain to fit"
            )
        split = self.residual_val_split
        if not (split in ("interleave", "last") or (split.startswith("random:") and split[7:].isdigit())):
            raise ConfigError(f"--residual_val_split must be interleave, last or random:<seed>; got {split!r}")

    def check(self, config) -> None:
        policy = config.policy
        if not policy.evicts:
            raise ConfigError(f"--residual summarises evicted tokens; --method {policy.name} evicts nothing")
        if policy.ranks_by_position:
            raise ConfigError(
                f"--residual splits a scorer's ranking into main and residual slots; --method {policy.name} keeps "
                "tokens by position (sinks + recent), and a smaller main cache would drop its sinks"
            )
        if config.merger is not None:
            merging = config.chosen_by(config.merger)
            raise ConfigError(
                f"--residual keeps the main cache exact and summarises the evicted tokens itself; {merging} already "
                "merges them into the kept entries (they would count twice)"
            )

    def readout(self, validation: bool = False) -> ResidualReadout:
        """How attention reads the entries; ``validation=True`` honours ``--no-residual_val_gate``."""
        gate = not self.residual_no_gate and (self.residual_val_gate or not validation)
        return ResidualReadout(
            beta=self.residual_beta,
            gate=gate,
            tau=self.residual_gate_tau,
            alpha=self.residual_gate_alpha,
            gate_min=self.residual_gate_min,
            separate_softmax=self.residual_separate_softmax,
        )

    def build(self, ctx, scores: torch.Tensor, keep: torch.Tensor) -> ResidualPlan:
        """The layer's residual entries for the base budgets ``keep`` ``[B, H_kv]``."""
        return build_residual(self, ctx, scores, keep)

    def reserve(self, ctx, scores: torch.Tensor, keep: torch.Tensor, previous=()) -> Reservation:
        """Each head's residual share of its budget and the entries of what it then evicts. A head
        that already holds ``r`` entries (``previous``: a layer compressed again, whose budget was
        already lowered by them) keeps them, and what it evicts now is folded in (``summarise``);
        the others are built afresh."""
        old = next((segment for segment in previous if isinstance(segment, ResidualEntries)), None)
        fresh = torch.ones_like(keep, dtype=torch.bool) if old is None else old.counts().to(keep.device) == 0
        plan = self.build(ctx, scores, keep) if bool(fresh.any()) else None
        sizes = torch.zeros_like(keep) if plan is None else torch.where(fresh, plan.sizes, 0)
        return Reservation(scores, keep - sizes, (plan, old, fresh))

    def summarise(self, ctx, columns: torch.Tensor, memo) -> list:
        """The layer's ``ResidualEntries``: the ones ``reserve`` built, and on heads that held entries
        before, those entries with this compression's evicted tokens folded in (weighted k-means,
        each old entry weighing its member count); none if no head has one."""
        plan, old, fresh = memo
        if old is None:
            if not bool(plan.sizes.any()):
                return []
            oldest = ctx.positions_of(plan.first_columns)
            return [ResidualEntries(plan.keys, plan.values, plan.log_counts, self.readout(), oldest)]
        batch, heads = fresh.shape
        rows = [[self._head_entries(ctx, columns, plan, old, fresh, row, head) for head in range(heads)]
                for row in range(batch)]
        width = max(keys.shape[0] for row in rows for keys, _, _ in row)
        if width == 0:
            return []
        keys = old.keys.new_zeros(batch, heads, width, old.keys.shape[-1])
        values = old.values.new_zeros(batch, heads, width, old.values.shape[-1])
        log_counts = torch.full((batch, heads, width), float("-inf"), device=old.log_counts.device)
        for row, entries in enumerate(rows):
            for head, (entry_keys, entry_values, entry_counts) in enumerate(entries):
                used = entry_keys.shape[0]
                if used:  # right-aligned in the head's last slots
                    keys[row, head, width - used :] = entry_keys.to(keys.dtype)
                    values[row, head, width - used :] = entry_values.to(values.dtype)
                    log_counts[row, head, width - used :] = entry_counts.log()
        return [ResidualEntries(keys, values, log_counts, self.readout())]

    def _head_entries(self, ctx, columns: torch.Tensor, plan, old: ResidualEntries, fresh: torch.Tensor, row: int,
                      head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys [r, d], values [r, d], counts [r])`` of one head's entries after this compression."""
        if bool(fresh[row, head]):
            used = torch.isfinite(plan.log_counts[row, head])
            return (plan.keys[row, head, used].float(), plan.values[row, head, used].float(),
                    plan.log_counts[row, head, used].exp().round())
        used = torch.isfinite(old.log_counts[row, head])
        entry_keys, entry_values = old.keys[row, head, used], old.values[row, head, used]
        entry_counts = old.log_counts[row, head, used].exp().round()
        evicted = ctx.plan.visible[row].clone()
        kept = columns[row, head]
        evicted[kept[kept >= 0].long()] = False
        if not bool(evicted.any()):
            return entry_keys.float(), entry_values.float(), entry_counts
        return fold_into_entries(entry_keys, entry_values, entry_counts, ctx.key[row, head, evicted],
                                 ctx.value[row, head, evicted], self.residual_iters)
