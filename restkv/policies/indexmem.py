"""IndexMem (arXiv 2605.25475): a learned indexer chooses what to keep, a latent memory keeps the rest.

The indexer's score replaces the window attention; the evicted tokens are written into a
compact per-KV-head memory that decode steps and question chunks read as a gated residual
outside the softmax (``restkv.learned.indexmem`` has the parts and the equations). The memory's
numbers count against the budget: every head that evicts keeps ``slots`` fewer tokens, the
memory's size in key+value slots of the cache (``cache_report``'s ``extra`` column), so a
layer holds the bytes SnapKV holds at the same budget.

With ``--indexmem_weights`` (trained by ``python -m restkv.tools.train_indexmem``) the learned indexer
scores and the learned memory reads with the file's fusion; the memory and its gate read the
keys and queries the file was trained on, before RoPE by default (the paper: the memory carries
no position), so the compression call passes ``pre_rope_key`` to ``summarise`` and the decode
read ``pre_rope_query`` to ``MemoryState.correct`` (``restkv.scoring.rope``). Without weights the
training-free fallback runs (and says so once): the indexer is the window attention (SnapKV's
score), and the memory holds random features of ``exp(scale <q, k>)`` of the post-RoPE keys
and queries read through the shared softmax (the evicted mass joins it), which estimates the
evicted tokens' exact contribution (the attention logits are those of the rotated vectors).
Not the authors' successor IndexMem++ (a query-independent scorer with centroid slots).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from restkv.cache.segments.memory import MemoryState, memory_input, slots_for
from restkv.config.options import ConfigError, option, register
from restkv.learned.indexmem import FUSIONS, QUERY_REDUCTIONS, Architecture, IndexMemLayer, load_weights
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import PooledScores
from restkv.scoring.selection import Reservation

if TYPE_CHECKING:
    from restkv.config import CompressionConfig, ModelShape

_FALLBACK_WARNED = False


@register("method")
@dataclass(frozen=True)
class IndexMem(PooledScores):
    name = "indexmem"
    reference = "IndexMem: Yang, Gu et al., ICML 2026, arXiv 2605.25475"

    indexmem_weights: str | None = option(
        None, "IndexMem weights file (python -m restkv.tools.train_indexmem); without it the training-free "
              "fallback runs",
        names_file=True)
    indexmem_features: int = option(32, "features of the latent memory per KV head (its size: features x (head_dim "
                                        "+ 1) float32 numbers, taken from the budget in token slots)", minimum=1)
    indexmem_query_reduction: str = option("mean", "how the indexer's scores are reduced over the observation queries",
                                           QUERY_REDUCTIONS)
    indexmem_fusion: str = option("auto", "how the memory's read joins attention: residual o + g(q) m(q) (the "
                                          "paper as reported), shared_softmax (the evicted mass joins the "
                                          "softmax); auto: the weights file's, shared_softmax without weights",
                                  ("auto",) + FUSIONS)
    indexmem_memory: bool = option(True, "keep the latent memory of the evicted tokens (off: the indexer alone, "
                                         "every slot for tokens)")

    def check(self, config: "CompressionConfig") -> None:
        super().check(config)
        for summary in ("residual", "moments"):
            if config.switch(summary) is not None:
                raise ConfigError("--method indexmem keeps its own memory of the evicted tokens; it does not "
                                  f"combine with --{summary}")
        if config.rescores:
            raise ConfigError("--method indexmem writes its memory when the prompt is compressed; "
                              "--prefill_chunk_size and --decode_budget are not supported")
        if self.indexmem_weights is None:
            if self.indexmem_fusion == "residual":
                raise ConfigError("--indexmem_fusion residual needs a trained gate: give --indexmem_weights")
            return
        weights = _weights(self.indexmem_weights)
        if config.run.observation == "reconstruction":
            raise ConfigError("--indexmem_weights: the learned indexer scores with the window's queries; "
                              "--observation reconstruction applies to the training-free fallback only")
        if weights.arch.features != self.indexmem_features:
            raise ConfigError(f"--indexmem_features {self.indexmem_features} differs from the "
                              f"{weights.arch.features} features of --indexmem_weights {self.indexmem_weights}")

    def check_model(self, config: "CompressionConfig", model: "ModelShape") -> None:
        if self.indexmem_weights is not None:
            self._check_weights_shape(model.num_layers, model.num_heads, model.num_kv_heads, model.head_dim)
        budget = config.run.max_capacity_prompts
        if budget is None or not self.indexmem_memory or all(w is not None for w in model.sliding_windows):
            return
        slots = slots_for(self.indexmem_features, model.head_dim, 2 * model.head_dim * model.element_size)
        protected = self.protected_count(config.run.window_size, budget)
        if budget - slots < protected:
            raise self._no_room(slots, model.head_dim, budget, protected)

    def _check_weights_shape(self, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        arch = _weights(self.indexmem_weights).arch
        model = (num_layers, num_heads, num_kv_heads, head_dim)
        if (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) != model:
            raise ConfigError(
                f"--indexmem_weights {self.indexmem_weights} was trained for layers/heads/KV heads/head dim "
                f"{arch.num_layers}/{arch.num_heads}/{arch.num_kv_heads}/{arch.head_dim}; this model has "
                f"{'/'.join(map(str, model))}")

    def _no_room(self, slots: int, head_dim: int, budget: int, protected: int) -> ConfigError:
        return ConfigError(
            f"--method indexmem: the latent memory takes {slots} token slots per KV head (--indexmem_features "
            f"{self.indexmem_features}, head dim {head_dim}); a budget of {budget} tokens then keeps fewer than the "
            f"{protected} protected ones (--window_size). Raise the budget, lower --indexmem_features or turn the "
            "memory off (--no-indexmem_memory)")

    @property
    def fusion(self) -> str:
        if self.indexmem_fusion != "auto":
            return self.indexmem_fusion
        return _weights(self.indexmem_weights).arch.fusion if self.indexmem_weights else "shared_softmax"

    def layer_for(self, ctx: LayerInputs) -> IndexMemLayer:
        """The layer's trained parts, or the fallback's, on the context's device."""
        num_heads, head_dim = ctx.query.shape[1], ctx.key.shape[-1]
        if self.indexmem_weights is None:
            _warn_fallback()
            arch = Architecture(ctx.num_layers, num_heads, ctx.num_kv_heads, head_dim, self.indexmem_features,
                                memory_inputs="post_rope")
            layer = _fallback_layer(arch, ctx.layer_idx, ctx.plan.seed)
        else:
            self._check_weights_shape(ctx.num_layers, num_heads, ctx.num_kv_heads, head_dim)
            layer = _weights(self.indexmem_weights).layers[ctx.layer_idx]
        return _on_device(layer, ctx.key.device)

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        if self.indexmem_weights is None:
            observation = ctx.observation
            reduction = self.indexmem_query_reduction
            per_head = {"mean": observation.total, "max": observation.maximum, "last": observation.last}[reduction]()
        else:
            per_head = self.layer_for(ctx).importance(ctx.query, ctx.key, ctx.plan.valid, ctx.window_size,
                                                      self.indexmem_query_reduction, ctx.plan.sliding_window)
        return self.smooth(ctx, self.reduce(ctx, per_head))

    # ------------------------------------------------------------ the memory
    def memory_slots(self, ctx: LayerInputs) -> int:
        """Token slots the memory takes per evicting KV head (0 without one)."""
        if not self.indexmem_memory or ctx.plan.sliding_window is not None:
            return 0
        return slots_for(self.indexmem_features, ctx.key.shape[-1], _slot_bytes(ctx))

    def reserve(self, ctx: LayerInputs, scores: torch.Tensor, keep: torch.Tensor, previous=()) -> Reservation:
        slots = self.memory_slots(ctx)
        if slots == 0:
            return Reservation(scores, keep)
        evicting = (ctx.plan.budgets < ctx.plan.visible_counts)[:, None]
        reserved = torch.where(evicting, keep - slots, keep)
        protected = ctx.protected.sum(dim=-1, keepdim=True)
        if bool((reserved < protected).any()):
            raise self._no_room(slots, ctx.key.shape[-1], int(keep.min()), int(protected.max()))
        return Reservation(scores, reserved)

    def summarise(self, ctx: LayerInputs, columns: torch.Tensor, memo) -> list:
        """The memory of the tokens ``columns`` evicts (a memory trained on pre-RoPE keys reads
        ``ctx.pre_rope_key``)."""
        if self.memory_slots(ctx) == 0:
            return []
        length = ctx.key.shape[2]
        kept = torch.zeros(ctx.key.shape[:3], dtype=torch.bool, device=ctx.key.device)
        kept.scatter_(2, columns.clamp(min=0), columns >= 0)
        evicted = ctx.visible[:, None, :] & ~kept
        ages = torch.arange(length - 1, -1, -1, device=ctx.key.device)
        layer = self.layer_for(ctx)
        keys = memory_input(layer.arch, ctx.key, ctx.pre_rope_key, "keys")
        with torch.no_grad():
            state = layer.write(keys, ctx.value, evicted, ages, ctx.scaling)
        return [MemoryState(state.log_mass, state.feature_values, layer, self.fusion, ctx.scaling, _slot_bytes(ctx))]


def _slot_bytes(ctx: LayerInputs) -> int:
    """Bytes of one token slot: its key and value in one KV head."""
    return 2 * ctx.key.shape[-1] * ctx.key.element_size()


@functools.lru_cache(maxsize=4)
def _cached_weights(path: str, modified: float):
    return load_weights(path)


def _weights(path: str):
    """The weights file at ``path`` (read once while it is unchanged)."""
    file = Path(path)
    return _cached_weights(str(file.resolve()), file.stat().st_mtime if file.is_file() else 0.0)


@functools.lru_cache(maxsize=512)
def _fallback_layer(arch: Architecture, layer_idx: int, seed: int) -> IndexMemLayer:
    return IndexMemLayer.fallback(arch, layer_idx, seed)


_DEVICE_COPIES: dict[tuple[int, str], IndexMemLayer] = {}


def _on_device(layer: IndexMemLayer, device: torch.device) -> IndexMemLayer:
    """``layer`` on ``device`` (CPU layers as they are; one copy per other device)."""
    if torch.device(device).type == "cpu":
        return layer
    key = (id(layer), str(device))
    if key not in _DEVICE_COPIES:
        copy = IndexMemLayer(layer.arch).to(device)
        copy.load_state_dict(layer.state_dict())
        _DEVICE_COPIES[key] = copy.requires_grad_(False)
    return _DEVICE_COPIES[key]


def _warn_fallback() -> None:
    global _FALLBACK_WARNED
    if not _FALLBACK_WARNED:
        _FALLBACK_WARNED = True
        warnings.warn("restkv: --method indexmem without --indexmem_weights runs the training-free fallback (window "
                      "attention as the indexer, a random-feature memory read through the shared softmax); train "
                      "weights with python -m restkv.tools.train_indexmem", UserWarning, stacklevel=3)
