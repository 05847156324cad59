"""Tiny randomly initialised models of every supported family, for fast CPU tests."""

from __future__ import annotations

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from restkv.monkeypatch import replace_gemma, replace_llama, replace_mistral, replace_qwen2

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, replace_llama, {}),
    "mistral": (MistralConfig, MistralForCausalLM, replace_mistral, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, replace_qwen2, {}),
    "gemma": (GemmaConfig, GemmaForCausalLM, replace_gemma, {"head_dim": 16}),
    "gemma2": (
        Gemma2Config,
        Gemma2ForCausalLM,
        replace_gemma,
        # A sliding window longer than the test prompts, with soft-capping on.
        {"head_dim": 16, "sliding_window": 512, "attn_logit_softcapping": 50.0, "query_pre_attn_scalar": 16},
    ),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        replace_gemma,
        {"head_dim": 16, "sliding_window": 512, "query_pre_attn_scalar": 16, "layer_types": None},
    ),
}


#: transformers has no sdpa path for Gemma 2 (soft-capping); it runs eager only.
SDPA_UNSUPPORTED = {"gemma2"}

FAMILY_BACKENDS = [
    (family, backend)
    for family in FAMILIES
    for backend in ("eager", "sdpa")
    if not (backend == "sdpa" and family in SDPA_UNSUPPORTED)
]


def tiny_model(family: str, attn_implementation: str = "sdpa", seed: int = 0, **overrides):
    """A tiny random model of ``family`` in float32, eval mode."""
    config_cls, model_cls, _, extra = FAMILIES[family]
    options = {**COMMON, **extra, **overrides}
    if family == "gemma3" and options.get("layer_types") is None:
        options["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention"][: options["num_hidden_layers"]]
    config = config_cls(**options)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Random init gives near-uniform attention; sharpen it so compression changes outputs.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(4.0)
    return model


def replace_for(family: str):
    """The ``replace_*`` function that patches ``family``."""
    return FAMILIES[family][2]


def random_prompt(batch: int, length: int, seed: int = 1, vocab: int = 256) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=generator)


def left_padded(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch of random prompts of the given lengths: (input_ids, attention_mask)."""
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = random_prompt(1, length, seed=seed + row)[0]
        mask[row, width - length :] = 1
    return ids, mask
