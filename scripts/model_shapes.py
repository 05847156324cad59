"""Model shapes built with random weights, for measurements that depend on shapes, not on
weights (``scripts/gpu_bench.py``, ``scripts/efficiency.py --model_shape``)."""

from __future__ import annotations

import sys
from pathlib import Path

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


def shape_flag_of_old(argv: list[str] | None) -> list[str]:
    """``argv`` (default ``sys.argv[1:]``) with ``--config NAME`` naming a shape, not a file, written
    ``--model_shape NAME``: the shape's flag was ``--config`` before ``--config`` read a file of flags,
    and earlier command lines keep working."""
    tokens = list(sys.argv[1:] if argv is None else argv)
    for index, token in enumerate(tokens):
        name, has_value, value = token.partition("=")
        if has_value and name == "--config" and value in CONFIGS and not Path(value).exists():
            tokens[index] = f"--model_shape={value}"
        elif (token == "--config" and index + 1 < len(tokens) and tokens[index + 1] in CONFIGS
              and not Path(tokens[index + 1]).exists()):
            tokens[index] = "--model_shape"
    return tokens


def build_model(name: str, dtype: torch.dtype, device: torch.device, attn_implementation: str, max_positions: int):
    """A randomly initialised causal LM of shape ``name``, created (and initialised) on ``device``."""
    config_class, fields = CONFIGS[name]
    config = config_class(**fields, max_position_embeddings=max_positions)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval()
