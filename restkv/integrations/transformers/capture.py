"""Names restkv's attention backend takes, and the capture of a module's kernel inputs.

The backend over a native implementation ``name`` is ``restkv_<name>`` (``restkv.integrations.transformers.backend``).
``attention_inputs`` runs an attention module's own forward to its kernel call and takes the post-RoPE queries,
keys and values it hands it: what the rotation probe (``rotation``) and the offline projections read.
"""

from __future__ import annotations

import torch

#: the attention implementations restkv serves: its backend over each that transformers has (the native kernel
#: runs the prefill; restkv reads compressed layers itself)
SERVED_KERNELS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")
#: restkv's backend for implementation ``name`` is registered as ``restkv_<name>``
BACKEND_PREFIX = "restkv_"
#: attention module -> what ``attention_inputs`` captures (only while it runs)
CAPTURES: dict[torch.nn.Module, list] = {}


def backend_name(implementation: str) -> str:
    """The name of restkv's backend over a native attention implementation (``sdpa`` -> ``restkv_sdpa``)."""
    return implementation if implementation.startswith(BACKEND_PREFIX) else BACKEND_PREFIX + implementation


def native_name(implementation: str) -> str:
    """The native implementation a backend name runs (``restkv_sdpa`` -> ``sdpa``)."""
    return implementation.removeprefix(BACKEND_PREFIX)


class Captured(Exception):
    """Ends a module's forward once its kernel's inputs are captured (``attention_inputs``)."""


def attention_inputs(module: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings):
    """Post-RoPE ``query [B, H, N, d]``, ``key``, ``value [B, H_kv, N, d]`` of an attention module, as its
    own forward hands them to its kernel (its projections, norms and RoPE with ``position_embeddings``);
    no cache, nothing after the kernel runs."""
    implementation = module.config._attn_implementation
    captured = CAPTURES[module] = []
    module.config._attn_implementation = backend_name(implementation)  # the kernel call reaches the backend
    try:
        # forward, not __call__: the module's hooks (a caller's own capture) stay out of it
        module.forward(hidden_states=hidden_states, position_embeddings=position_embeddings, attention_mask=None)
    except Captured:
        pass
    finally:
        del CAPTURES[module]
        module.config._attn_implementation = implementation
    if not captured:
        raise ValueError(f"restkv: {type(module).__name__} does not call an attention function of the registry")
    return tuple(captured)
