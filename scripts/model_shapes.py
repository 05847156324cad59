"""Model shapes built with random weights, for measurements that depend on shapes, not on
weights (``scripts/gpu_bench.py``, ``scripts/efficiency.py --config``)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

#: model shapes: (config class, fields); the 7-8B ones are the published models' shapes
CONFIGS = {
    "llama-8b": (LlamaConfig, dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
    )),
    "mistral-7b": (MistralConfig, dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32768, rope_theta=1000000.0, rms_norm_eps=1e-5, sliding_window=None,
    )),
    "qwen2-7b": (Qwen2Config, dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, rope_theta=1000000.0, rms_norm_eps=1e-6,
    )),
    "tiny": (LlamaConfig, dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256,
    )),
    # Small enough for a CPU at 16K tokens, wide enough that the cache and the activations,
    # not the weights, dominate what a prefill holds (16 KiB of float32 K/V per token).
    "tiny-wide": (LlamaConfig, dict(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=8, vocab_size=2048,
    )),
}


def build_model(name: str, dtype: torch.dtype, device: torch.device, attn_implementation: str, max_positions: int):
    """A randomly initialised causal LM of shape ``name``, created (and initialised) on ``device``."""
    config_class, fields = CONFIGS[name]
    config = config_class(**fields, max_position_embeddings=max_positions)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval()
