"""IndexMem's latent memory of a layer's evicted tokens (``--method indexmem``): a correction segment,
applied to the merged output of the exact tokens with their log-sum-exp (``restkv.learned.indexmem``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from restkv.cache.segments.base import SegmentReport, tensor_bytes
from restkv.config.options import ConfigError


@dataclass
class MemoryState:
    """One layer's latent memory of its evicted tokens: an output correction of the compressed
    layer (``restkv.cache``), applied after its segments' merged softmax."""

    kind = "indexmem memory"

    log_mass: torch.Tensor  # [B, H_kv, F] float32 log b (-inf: nothing written)
    feature_values: torch.Tensor  # [B, H_kv, F, d] float32 M / b
    #: the layer's trained parts (``restkv.learned.indexmem.IndexMemLayer``), which write and read the state
    layer: Any
    fusion: str = "residual"
    scaling: float = 1.0
    #: bytes of one token slot of the cache (key + value of one head)
    slot_bytes: int = 1

    def correct(self, query: torch.Tensor, output: torch.Tensor, lse: torch.Tensor,
                pre_rope_query: torch.Tensor | None = None) -> torch.Tensor:
        """The corrected output ``[B, q, H, d]`` from the post-RoPE ``query`` ``[B, H, q, d]``, the
        attention ``output`` and its ``lse``; a ``pre_rope`` memory reads ``pre_rope_query`` (the
        same query before RoPE: ``restkv.scoring.rope.unrotate`` with the step's position embeddings)."""
        memory_query = memory_input(self.layer.arch, query, pre_rope_query, "queries")
        readout, log_mass = self.layer.read(self, memory_query, self.scaling)
        fused = self.layer.fuse(output.transpose(1, 2), lse, readout, log_mass, memory_query, self.fusion)
        return fused.transpose(1, 2).to(output.dtype)

    def tensors(self) -> Iterable[torch.Tensor]:
        return (self.log_mass, self.feature_values)

    def token_slots(self) -> float:
        return slots_for(self.log_mass.shape[-1], self.feature_values.shape[-1], self.slot_bytes)

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "MemoryState":
        return MemoryState(fn(self.log_mass), fn(self.feature_values), self.layer, self.fusion, self.scaling,
                           self.slot_bytes)

    def report(self) -> SegmentReport:
        return SegmentReport(self.kind, None, float(self.token_slots()), tensor_bytes(self.tensors()))

    def fork(self) -> "MemoryState":
        return self  # never written in place


def memory_input(arch: Any, post_rope: torch.Tensor, pre_rope: torch.Tensor | None,
                 what: str) -> torch.Tensor:
    """The ``what`` (keys or queries) a memory of ``arch`` reads: ``post_rope``, or ``pre_rope``,
    which its caller must give for a ``pre_rope`` memory."""
    if arch.memory_inputs == "post_rope":
        return post_rope
    if pre_rope is None:
        raise ConfigError(f"--indexmem_weights: this memory reads pre-RoPE {what} (trained with --memory_inputs "
                          f"pre_rope) and none were passed (restkv.scoring.rope makes them from the post-RoPE ones)")
    return pre_rope


def slots_for(features: int, head_dim: int, slot_bytes: int) -> int:
    """Token slots (of ``slot_bytes`` each) that a float32 memory of ``features`` features takes
    per KV head: ``ceil(4 F (d + 1) / slot_bytes)``."""
    return math.ceil(4 * features * (head_dim + 1) / slot_bytes)
