"""``--allocation headkv`` (HeadKV, arXiv 2410.19258): per-head budgets from a file of head importance
scores, model-wide: per-layer totals vary, the model total is exactly ``N * H_kv * B``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch

from restkv.allocations.base import Allocation, clamp_spreading_excess, round_to_total
from restkv.config.options import ConfigError, option, register
from restkv.files.head_scores import load_head_scores, read_head_score_file
from restkv.files.reading import read_file_once


@register("allocation")
@dataclass(frozen=True)
class HeadKVAllocation(Allocation):
    """HeadKV's per-head budgets from a head-score file, model-wide (``headkv_table``)."""

    name = "headkv"
    reference = "HeadKV: Fu et al., 2024, arXiv 2410.19258"
    head_adaptive = True

    head_scores: str | None = option(
        None, "HeadKV: JSON file of per-head importance scores (python -m restkv.tools.head_scores computes one)",
        names_file=True,
    )
    head_beta: float = option(1.01, "HeadKV: budget / head_beta candidates per head are pooled and redistributed",
                              minimum=1)
    head_temp: float = option(1.0, "HeadKV: temperature applied to the normalised head scores",
                              minimum=0, exclusive_minimum=True)
    headkv_window_outside: bool = option(
        False, "HeadKV: the reference runner's semantics, window kept on top of the head capacity"
    )

    def __post_init__(self) -> None:
        if isinstance(self.head_scores, os.PathLike):
            object.__setattr__(self, "head_scores", os.fspath(self.head_scores))
        super().__post_init__()

    def validate(self) -> None:
        if self.head_scores is not None:
            read_file_once(self.head_scores, "--head_scores", read_head_score_file)

    def check(self, config) -> None:
        if self.head_scores is None:
            raise ConfigError(
                "HeadKV allocation needs --head_scores FILE (per-head scores; compute one with python -m "
                "restkv.tools.head_scores --model_path MODEL --out "
                "data/heads_score/MODEL_retrieval_reasoning_heads.json)"
            )

    def check_model(self, config, model) -> None:
        try:
            load_head_scores(self.head_scores, model.num_layers, model.num_heads)
        except ValueError as error:
            raise ConfigError(f"--head_scores: {error}") from None

    def candidate_counts(self, layer, scores, shape, available):
        path = os.path.abspath(self.head_scores)
        # The reference runner computes capacities from C and keeps the window on top.
        budget = shape.budget if self.headkv_window_outside else shape.candidate_budget
        table = headkv_table(
            path,
            os.path.getmtime(path),
            budget,
            shape.candidates,
            layer.num_layers,
            layer.num_heads,
            layer.num_kv_heads,
            self.head_beta,
            self.head_temp,
        )
        return torch.minimum(torch.tensor(table[layer.layer_idx], dtype=torch.long), available)


# ---------------------------------------------------------------- HeadKV
@lru_cache(maxsize=64)
def headkv_table(
    path: str,
    mtime: float,
    budget: int,
    available: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    beta: float = 1.01,
    temperature: float = 1.0,
) -> tuple[tuple[int, ...], ...]:
    """HeadKV's candidate count of every (layer, KV head), model-wide.

    Head importance ``s`` (mean of each head's probe scores, normalised to sum 1, then
    ``s^T / sum s^T``) is summed over each query group; each KV head gets
    ``s * pool + base`` with ``pool = floor(B / beta) * N * H_kv`` and
    ``base = B - floor(B / beta)``. Counts above ``available`` are clamped and the excess is
    spread over the other heads in proportion to their scores; largest-remainder rounding
    makes the model total exactly ``N * H_kv * B``. ``mtime`` keys the cache, so a file
    rewritten in place is read again. Computed once per (file, budget, row length, model
    shape), not per layer.
    """
    importance = load_head_scores(path, num_layers, num_heads).double()
    importance = importance / importance.sum()
    importance = importance**temperature
    importance = importance / importance.sum()
    per_kv_head = importance.view(num_layers, num_kv_heads, num_heads // num_kv_heads).sum(dim=-1).flatten()
    pooled = int(budget // beta)
    ideal = per_kv_head * (pooled * num_layers * num_kv_heads) + (budget - pooled)
    total = num_layers * num_kv_heads * budget
    counts = round_to_total(clamp_spreading_excess(ideal, per_kv_head, float(available)), total, available)
    return tuple(tuple(row) for row in counts.view(num_layers, num_kv_heads).tolist())
