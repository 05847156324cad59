"""``--method duo_attention``'s allocation: streaming heads (from a DuoAttention pattern file, or scored
from the model on the fly: ``restkv.integrations.transformers.duo_scores``) keep StreamingLLM's tokens,
retrieval heads everything."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch

from restkv.allocations.base import Allocation
from restkv.config.options import ConfigError, option, register
from restkv.files.reading import read_file_once


def _read_pattern(path: str) -> tuple[tuple[float, ...], ...]:
    if path.endswith(".tsv"):
        table = np.loadtxt(path, dtype=float, delimiter="\t", ndmin=2)
    else:
        with open(path) as handle:
            data = json.load(handle)
        if not isinstance(data, dict) or "head_scores" not in data:
            raise ValueError("a DuoAttention pattern is a JSON object with 'head_scores' [layers][KV heads]")
        table = np.asarray(data["head_scores"], dtype=float)
    if table.ndim != 2 or table.size == 0 or not np.isfinite(table).all():
        raise ValueError(f"head scores must be a finite [layers][KV heads] table; got shape {table.shape}")
    return tuple(map(tuple, np.clip(table, 0.0, 1.0).tolist()))


def read_duo_pattern(path: str) -> np.ndarray:
    """``[L, H_kv]`` the pattern file's head scores, clipped to [0, 1]."""
    return np.array(read_file_once(path, "--duo_pattern", _read_pattern))


def streaming_heads(scores: np.ndarray, ratio: float) -> np.ndarray:
    """``[L, H_kv]`` bool: the ``round(L H_kv ratio)`` lowest-scored heads of the model."""
    streaming = np.zeros(scores.size, dtype=bool)
    streaming[np.argsort(scores, axis=None, kind="stable")[: round(scores.size * ratio)]] = True
    return streaming.reshape(scores.shape)


@register("allocation")
@dataclass(frozen=True)
class DuoAllocation(Allocation):
    """DuoAttention's: a streaming head keeps the budget (StreamingLLM's tokens), a retrieval head every token."""

    name = "duo"
    reference = "DuoAttention: Xiao et al., ICLR 2025, arXiv 2410.10819"
    head_adaptive = True
    may_keep_whole = True

    duo_pattern: str | None = option(
        None, "DuoAttention: the head pattern file (JSON head_scores [layers][KV heads], or DuoAttention's "
        "full_attention_heads.tsv; python -m restkv.tools.duo_pattern computes one)", names_file=True)
    duo_streaming_ratio: float = option(0.5, "DuoAttention: the share of the model's KV heads that stream (lowest "
                                             "pattern scores)", minimum=0, maximum=1)
    duo_on_the_fly: bool = option(
        False, "DuoAttention: with no --duo_pattern, score the heads from the model when it is configured (kvpress' "
        "on_the_fly_scoring, on restkv's generated text; once per model, kept as a pattern file in restkv's cache "
        "folder, which the model's config then names)")

    def __post_init__(self) -> None:
        if isinstance(self.duo_pattern, os.PathLike):
            object.__setattr__(self, "duo_pattern", os.fspath(self.duo_pattern))
        super().__post_init__()

    def validate(self) -> None:
        if self.duo_pattern is not None:
            read_duo_pattern(self.duo_pattern)

    def check(self, config) -> None:
        if self.duo_pattern is None and not self.duo_on_the_fly:
            raise ConfigError("--allocation duo needs --duo_pattern FILE (head scores; compute one with python -m "
                              "restkv.tools.duo_pattern --model_path MODEL --out FILE) or --duo_on_the_fly")
        if self.duo_pattern is not None and self.duo_on_the_fly:
            raise ConfigError(f"--duo_on_the_fly scores the heads from the model; --duo_pattern {self.duo_pattern} "
                              "gives them: give one")
        flags = config.rescoring_flags()
        if flags:
            raise ConfigError(f"--allocation duo keeps each head's prefill count; {' and '.join(flags)} would "
                              "compress the heads again to one budget")

    def check_model(self, config, model) -> None:
        if self.duo_pattern is None:  # scored from this model (restkv.integrations.transformers.duo_scores)
            return
        layers, heads = read_duo_pattern(self.duo_pattern).shape
        if (layers, heads) != (model.num_layers, model.num_kv_heads):
            raise ConfigError(f"--duo_pattern {self.duo_pattern} scores {layers} layers x {heads} KV heads; the model "
                              f"has {model.num_layers} x {model.num_kv_heads}: compute its own with python -m "
                              "restkv.tools.duo_pattern")

    def streaming(self, num_layers: int, num_kv_heads: int) -> np.ndarray:
        """``[L, H_kv]`` bool: the model's streaming heads."""
        if self.duo_pattern is None:
            raise ConfigError("--duo_on_the_fly scores the heads from the model when the config is given with it "
                              "(restkv.compression(model, ...), configure or replace_for_model); this layer was "
                              "compressed without it (replace_* of a family, compress_kv): give --duo_pattern FILE")
        scores = read_duo_pattern(self.duo_pattern)
        if scores.shape != (num_layers, num_kv_heads):
            raise ConfigError(f"--duo_pattern {self.duo_pattern} scores {scores.shape[0]} layers x {scores.shape[1]} "
                             f"KV heads; the layer belongs to a model of {num_layers} x {num_kv_heads}")
        return streaming_heads(scores, self.duo_streaming_ratio)

    def candidate_counts(self, layer, scores, shape, available):
        streaming = torch.from_numpy(self.streaming(layer.num_layers, layer.num_kv_heads)[layer.layer_idx])
        return torch.where(streaming, torch.minimum(available, torch.tensor(shape.candidate_budget)), available)
