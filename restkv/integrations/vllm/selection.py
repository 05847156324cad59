"""One request's layer compressed with restkv's own pipeline, in the token-major layout paged caches use.

vLLM hands its attention ``[tokens, heads, head_dim]`` tensors; restkv's pipeline reads ``[B, heads, tokens,
head_dim]``. ``select_kept`` turns one, runs the same plan, scoring and selection as the transformers path
(``restkv.pipeline.compress.compress_layer``) and turns the kept keys and values back, so the caller writes
them into a request's first slots with the attention backend's own cache-write kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.cache.segments.exact import joined_view
from restkv.config import CompressionConfig
from restkv.pipeline.compress import compress_layer
from restkv.pipeline.inputs import LayerFacts, LayerInputs
from restkv.pipeline.plan import plan_layer


@dataclass(frozen=True)
class KeptTokens:
    """What one layer of one request keeps.

    positions: ``[H_kv, K]`` the prompt positions each KV head keeps, ascending.
    keys, values: ``[K, H_kv, d]``: slot ``j`` of head ``h`` holds the token at ``positions[h, j]``.
    """

    positions: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor


def select_kept(config: CompressionConfig, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                kept: int, layer_idx: int, num_layers: int, scaling: float, softcap: float | None = None,
                o_proj_weight: torch.Tensor | None = None) -> KeptTokens:
    """The ``kept`` tokens per KV head of one request's layer.

    queries: ``[n, H_q, d]`` post-RoPE queries of the request's last ``n`` tokens (the observation window).
    keys, values: ``[L, H_kv, d]`` every token the layer holds for the request, in position order.
    o_proj_weight: ``[D, H_q * d]`` the layer's output projection, for scorers in output space (ReST-KV).
    """
    length = keys.shape[0]
    valid = torch.ones(1, length, dtype=torch.bool, device=keys.device)
    plan = plan_layer(config, valid, layer_idx, num_layers, budgets=[min(kept, length)])
    inputs = LayerInputs(queries.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                         plan, LayerFacts(scaling, softcap or None, None, o_proj_weight))
    kept_keys, kept_values, positions = joined_view(compress_layer(config, inputs).kept, appended=False)
    return KeptTokens(positions[0], kept_keys[0].transpose(0, 1), kept_values[0].transpose(0, 1))
