"""``--allocation lukv``: LU-KV's per-head budgets from a budget curve made offline for one model
and scorer (arXiv 2602.08585)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from restkv.allocations.base import Allocation, clamp_spreading_excess, round_to_total
from restkv.config.options import ConfigError, option, register
from restkv.files.reading import check_shape, finite_floats, read_file_once


@register("allocation")
@dataclass(frozen=True)
class LUKVAllocation(Allocation):
    """LU-KV's per-head budgets (arXiv 2602.08585) from a budget curve: ``--lukv_curve`` holds, for
    each compression ratio 1%..99%, every layer's and KV head's prune ratio (``[99, layers, KV
    heads]``, made offline by LU-KV's own tools for one model and one scorer). A row of ``L`` tokens
    with budget ``C`` reads the curve's row for ``round(100 (1 - C / L))%``; head ``h`` keeps
    ``(1 - p_h) L`` tokens, rounded so the layer keeps the rounded sum (largest remainders first),
    window and sinks included (kvpress' LUKVPress). The model never keeps more than ``C`` per head on
    average: a curve row that would (its prune ratios average below its ratio) is scaled down, the
    heads sharing the budget in proportion to their keep rates (``lukv_counts``)."""

    name = "lukv"
    reference = "LU-KV: arXiv 2602.08585"
    head_adaptive = True
    may_keep_whole = True

    lukv_curve: str | None = option(
        None, "LU-KV: .npy budget curve [99, layers, KV heads] of prune ratios in [0, 1] (row r - 1: ratio r "
        "percent), made for this model and scorer (LU-KV's published curves: --method expected_attention "
        "--ea_epsilon 0.02 --n_sink 4 --window_size 1)", names_file=True)

    def __post_init__(self) -> None:
        if isinstance(self.lukv_curve, os.PathLike):
            object.__setattr__(self, "lukv_curve", os.fspath(self.lukv_curve))
        super().__post_init__()

    def validate(self) -> None:
        if self.lukv_curve is not None:
            lukv_curve(self.lukv_curve)

    def check(self, config) -> None:
        if self.lukv_curve is None:
            raise ConfigError("--allocation lukv reads each head's budget from a curve: give --lukv_curve FILE.npy")
        flags = config.rescoring_flags()
        if flags:
            raise ConfigError(f"--allocation lukv reads the curve's row of the prompt's compression ratio; "
                              f"{' and '.join(flags)} would compress the layers again at other ratios")

    def check_model(self, config, model) -> None:
        self.check_curve(model.num_layers, model.num_kv_heads)

    def check_curve(self, num_layers: int, num_kv_heads: int) -> torch.Tensor:
        """The curve, refused (naming the flag) unless it is made for ``num_layers`` x ``num_kv_heads``."""
        curve = lukv_curve(self.lukv_curve)
        check_shape("--lukv_curve", self.lukv_curve, "the curve", curve.shape, (99, num_layers, num_kv_heads))
        return curve

    def candidate_counts(self, layer, scores, shape, available):
        curve = self.check_curve(layer.num_layers, layer.num_kv_heads)
        index = min(max(round(100 * (1 - shape.budget / shape.length)) - 1, 0), 98)
        kept = lukv_counts(curve[index], shape.length, shape.budget, shape.window)[layer.layer_idx]
        return torch.minimum(kept - shape.window, available)


def lukv_counts(prune: torch.Tensor, length: int, budget: int, protected: int) -> torch.Tensor:
    """``[layers, KV heads]`` tokens each head keeps of a row of ``length`` tokens under LU-KV's curve
    row ``prune`` (prune ratios): ``(1 - p) length``, each layer keeping its rounded sum (largest
    remainders first; kvpress' LUKVPress), each head at least its ``protected`` tokens (and 1). Where
    that exceeds the model's budget (``budget`` per head), the heads keep their protected tokens and
    share the rest of the budget in proportion to their keep rates instead."""
    num_layers, num_heads = prune.shape
    least = max(1, protected)
    ideal = (1 - prune) * length
    counts = ideal.floor().long()
    for layer in range(num_layers):
        target = min(max(round(float(ideal[layer].sum())), num_heads), num_heads * length)
        remainder = target - int(counts[layer].sum())
        if remainder > 0:
            counts[layer, torch.topk(ideal[layer] - counts[layer], min(remainder, num_heads)).indices] += 1
    counts = counts.clamp(min=least, max=length)
    total = num_layers * num_heads * budget
    if int(counts.sum()) <= total:
        return counts
    weights = ideal.flatten().double()
    pool, room = total - num_layers * num_heads * least, length - least
    shares = clamp_spreading_excess(weights / weights.sum() * pool, weights, float(room))
    return (round_to_total(shares, pool, room) + least).view(num_layers, num_heads)


def lukv_curve(path: str) -> torch.Tensor:
    """``[99, layers, KV heads]`` float32 prune ratios of a LU-KV curve file, read once while it is
    unchanged (``ConfigError`` naming ``--lukv_curve`` when it is not one)."""
    return read_file_once(path, "--lukv_curve", _read_curve)


def _read_curve(path: str) -> torch.Tensor:
    try:
        curve = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:
        raise ValueError(f"not a .npy array ({error})") from None
    if not isinstance(curve, np.ndarray):
        curve.close()
        raise ValueError("not a .npy array (an .npz archive?)")
    if curve.dtype.kind not in "fiu":
        raise ValueError(f"holds {curve.dtype} values, not prune ratios")
    if curve.ndim != 3 or curve.shape[0] != 99:
        raise ValueError(f"expected [99, layers, KV heads] prune ratios, got {list(curve.shape)}")
    ratios = finite_floats("--lukv_curve", path, {"the curve": torch.from_numpy(curve.astype(np.float32))})["the curve"]
    if bool(((ratios < 0) | (ratios > 1)).any()):
        raise ValueError(f"prune ratios must lie in [0, 1]; the curve holds {float(ratios.min()):g} to "
                         f"{float(ratios.max()):g}")
    return ratios
