"""Leverage scores (Chari & Van Durme, 2025, arXiv 2507.08143, Compactor's geometric part): keep the outlying keys.

A token's score is the statistical leverage of its key among the row's keys: with ``X`` the
row's pre-RoPE keys, centred over the row and multiplied by a Gaussian sketch ``G / sqrt(m)``
(``d x m`` per KV head, ``m = --leverage_sketch_dim``, drawn from ``--seed`` and the layer),
``l_i = x_i^T (X^T X + 0.01 I)^-1 x_i`` (a Cholesky solve; the jitter grows tenfold while the
factorisation fails), clamped at 0 and z-scored over the row's heads and tokens. A key far
from the directions most keys share has a high leverage: it is hard to reconstruct from the
others, so it stays. No query is read; the keys are read before RoPE, so a layer's RoPE tables
must be known (``compress_kv``'s ``rotary``), and a layer is scored once, in its prefill or
after it (model-wide allocations), never again by chunked prefill or a decode budget.

Where this differs from kvpress' ``LeverageScorePress``: the sketch comes from a generator
seeded with ``--seed`` and the layer (kvpress draws it from the global torch RNG on every call)
and the statistics are each row's own (kvpress z-scores over the whole batch); the recent
``--window_size`` tokens are kept as for every restkv scorer (kvpress protects none:
``--window_size 0`` reproduces it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from restkv.config.options import ConfigError, Options, option, register
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import Policy
from restkv.policies.random_control import layer_generator
from restkv.policies.row_local import score_rows

#: the jitter added to the sketched Gram matrix, and the factorisation's attempts at growing it
JITTER, ATTEMPTS = 1e-2, 5


@dataclass(frozen=True)
class SketchOptions(Options):
    leverage_sketch_dim: int = option(48, "leverage scores: columns of the Gaussian sketch of the keys", minimum=1)

    def leverage(self, ctx: LayerInputs, keys: torch.Tensor) -> torch.Tensor:
        """``[H_kv, n]`` z-scored leverage of one row's pre-RoPE ``keys`` ``[H_kv, n, d]``."""
        sketch = gaussian_sketch(ctx, self.leverage_sketch_dim)[0].to(keys.device, keys.dtype)
        centred = keys - keys.mean(dim=1, keepdim=True)
        sketched = (centred @ (sketch / math.sqrt(self.leverage_sketch_dim))).float()  # [H_kv, n, m]
        gram = sketched.transpose(1, 2) @ sketched
        factor = jittered_cholesky((gram + gram.transpose(1, 2)) / 2)
        solved = torch.cholesky_solve(sketched.transpose(1, 2), factor)  # (X^T X)^-1 X^T
        scores = (sketched * solved.transpose(1, 2)).sum(dim=-1).clamp_min(0)
        return (scores - scores.mean()) / scores.std().clamp_min(1e-6)


@register("method")
@dataclass(frozen=True)
class Leverage(SketchOptions, Policy):
    name = "leverage"
    reference = "Compactor's leverage scores: Chari & Van Durme, 2025, arXiv 2507.08143"
    observes_queries = False
    needs_rotary = True

    def check(self, config) -> None:
        super().check(config)
        if config.rescores:
            raise ConfigError(f"--method {self.name} reads the keys before RoPE with the prefill's RoPE tables; "
                              f"{' and '.join(config.rescoring_flags())} cannot score a layer again")

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        keys = ctx.pre_rope_key
        return score_rows(ctx, lambda row, columns: self.leverage(ctx, keys[row, :, columns].float()))


def gaussian_sketch(ctx: LayerInputs, columns: int) -> torch.Tensor:
    """``[1, H_kv, d, columns]`` standard Gaussian draws of the layer (``layer_generator``),
    shared by every row."""
    return torch.randn(1, ctx.num_kv_heads, ctx.key.shape[-1], columns, generator=layer_generator(ctx))


def jittered_cholesky(gram: torch.Tensor) -> torch.Tensor:
    """The lower Cholesky factor of ``gram + jitter I`` (``[..., m, m]``), the jitter ``JITTER``
    and ten times more on each failure."""
    identity = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    jitter = JITTER
    for _ in range(ATTEMPTS):
        factor, info = torch.linalg.cholesky_ex(gram + jitter * identity)
        if bool((info == 0).all()):
            return factor
        jitter *= 10
    raise RuntimeError(f"the sketched keys' Gram matrix is not positive definite even with jitter {jitter / 10:g}")
