"""Tiny randomly initialised models of every supported family, for fast CPU tests, and the
random inputs, generation and comparison helpers the tests share."""

from __future__ import annotations

import functools

import torch
from safetensors.torch import save_file
from transformers import (Cohere2Config, Cohere2ForCausalLM, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM,
                          Gemma3TextConfig, GemmaConfig, GemmaForCausalLM, GraniteConfig, GraniteForCausalLM,
                          LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Olmo2Config,
                          Olmo2ForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM, SmolLM3Config, SmolLM3ForCausalLM)

from restkv.integrations.transformers.compat import with_cache
from restkv.integrations.transformers.generation import position_ids_from_mask
from restkv.integrations.transformers.patching import (replace_family, replace_gemma, replace_llama, replace_mistral,
                                                       replace_qwen2)

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
    # q/k norms per head, and one sliding-window layer (Qwen3's layer_types)
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, functools.partial(replace_family, "qwen3"),
              {"head_dim": 16, "use_sliding_window": True, "sliding_window": 512, "max_window_layers": 2}),
    # Granite's multipliers: attention scaling, embedding, residual and logit scales
    "granite": (GraniteConfig, GraniteForCausalLM, functools.partial(replace_family, "granite"),
                {"attention_multiplier": 0.2, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                 "logits_scaling": 4.0}),
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
    # Families found through transformers' auto mappings: no table entry in restkv.
    # Phi-3: one fused qkv_proj.
    "phi3": (Phi3Config, Phi3ForCausalLM, functools.partial(replace_family, "phi3"), {"sliding_window": None}),
    # OLMo 2: q/k norms over all heads, norms after attention and MLP.
    "olmo2": (Olmo2Config, Olmo2ForCausalLM, functools.partial(replace_family, "olmo2"), {}),
    # SmolLM3: the middle layer has no RoPE (NoPE).
    "smollm3": (SmolLM3Config, SmolLM3ForCausalLM, functools.partial(replace_family, "smollm3"),
                {"no_rope_layers": [1, 0, 1]}),
    # Cohere 2: interleaved RoPE, parallel attention and MLP, a sliding layer beside full ones.
    "cohere2": (Cohere2Config, Cohere2ForCausalLM, functools.partial(replace_family, "cohere2"),
                {"sliding_window": 512, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                 "logit_scale": 0.5}),
}


#: families whose RoPE restkv does not undo (Cohere 2's interleaved channel pairs): a method that reads
#: keys before RoPE is refused there at the prefill
ROTATION_NOT_UNDONE = {"cohere2"}

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
            elif name.endswith("qkv_proj.weight"):  # Phi-3's fused projection: the query and key rows
                kv_rows = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
                param[: param.shape[0] - kv_rows].mul_(4.0)
    return model


def tiny_of_type(model_type: str, attn_implementation: str = "sdpa", **overrides):
    """A tiny random model of any transformers model type (no restkv table entry, no fixture), built from
    ``AutoConfig.for_model`` with the shared sizes (mixture-of-experts sizes shrunk where the config has them),
    q/k sharpened as ``tiny_model``'s."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**COMMON, "head_dim": 16, **overrides})
    for name, value in dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32).items():
        if hasattr(config, name) and name not in overrides:
            setattr(config, name, value)
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(4.0)
    return model


#: a Jamba (Mamba + attention) small enough for a unit test: layers 1 and 3 are attention
TINY_JAMBA = dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_expand=2,
                  mamba_dt_rank=4)


def replace_for(family: str):
    """The ``replace_*`` function that patches ``family``."""
    return FAMILIES[family][2]


def random_prompt(batch: int, length: int, seed: int = 1, vocab: int = 256) -> torch.Tensor:
    """Random token ids ``[batch, length]``, avoiding the pad, BOS and EOS ids (0-2)."""
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


def random_qkv(batch=1, heads=4, kv_heads=2, length=96, dim=16, seed=0):
    """Random post-RoPE ``(query, key, value)``: ``[batch, heads | kv_heads, length, dim]``, with
    queries and keys scaled by 2 so attention is peaked. One generator, drawn in that order."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, length, dim, generator=generator) * 2
    key = torch.randn(batch, kv_heads, length, dim, generator=generator) * 2
    value = torch.randn(batch, kv_heads, length, dim, generator=generator)
    return query, key, value


def rope_tables(query: torch.Tensor, attention_mask: torch.Tensor | None = None, base: float = 10000.0):
    """The default RoPE ``(cos, sin)`` ``[B, N, d]`` of each row's own positions (a left-padded
    row's first real token at 0), as ``compress_kv``'s ``rotary`` for scorers that read it."""
    batch, _, length, dim = query.shape
    positions = (torch.arange(length).expand(batch, -1) if attention_mask is None
                 else (attention_mask.cumsum(dim=-1) - 1).clamp(min=0))
    angles = positions[..., None].double() / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def assert_model_compresses(options: dict, length: int = 90, new_tokens: int = 3) -> None:
    """The tiny Llama patched with ``options`` generates after a prompt of ``length`` tokens, every
    layer of its cache compressed (what a part's composition matrix checks)."""
    from restkv.cache import cache_report
    from restkv.integrations.transformers.compat import output_cache

    model = tiny_model("llama")
    replace_for("llama")(**options)
    cache = output_cache(greedy(model, random_prompt(1, length), new_tokens=new_tokens))
    assert all(report.compressed for report in cache_report(cache))


def assert_refused_when_configured(options: dict, message: str, family: str = "llama") -> None:
    """``restkv.compression`` refuses ``options`` for a tiny ``family`` model with a ``ConfigError``
    matching ``message``, before the model runs (``check_model``: a file or setting made for another
    model shape)."""
    import pytest

    from restkv import ConfigError, compression

    model = tiny_model(family)

    def ran(module, args, kwargs):
        raise AssertionError("the model ran before the error was found")

    hook = model.register_forward_pre_hook(ran, with_kwargs=True)
    with pytest.raises(ConfigError, match=message):
        with compression(model, **options):
            pass
    hook.remove()


def greedy(model, input_ids, attention_mask=None, new_tokens=5):
    """Greedy generation of exactly ``new_tokens`` tokens (never stopping early on EOS, so rows
    stay comparable), returning the sequences, the per-step logits and the cache."""
    return model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
    )


def assert_patch_reproduces_unpatched(model, family, input_ids, attention_mask=None, new_tokens=5, **options):
    """Patch ``family`` with ``options`` and check that greedy generation is unchanged: the same
    tokens and the same logits (to 1e-5) as the unpatched model."""
    reference = greedy(model, input_ids, attention_mask, new_tokens)
    replace_for(family)(**options)
    patched = greedy(model, input_ids, attention_mask, new_tokens)
    assert torch.equal(patched.sequences, reference.sequences)
    for ours, theirs in zip(patched.logits, reference.logits):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def assert_rows_match_single_row_runs(model, lengths: list[int], new_tokens=5):
    """Greedy-generate a left-padded batch of prompts of ``lengths`` and check each row against
    its prompt run alone: the same new tokens and the same logits (to 1e-4). Returns the batched
    generation output."""
    input_ids, attention_mask = left_padded(lengths)
    batched = greedy(model, input_ids, attention_mask, new_tokens)
    width = input_ids.shape[1]
    for row, length in enumerate(lengths):
        alone = greedy(model, input_ids[row : row + 1, width - length :], new_tokens=new_tokens)
        assert torch.equal(batched.sequences[row, width:], alone.sequences[0, length:])
        for step_batched, step_alone in zip(batched.logits, alone.logits):
            torch.testing.assert_close(step_batched[row], step_alone[0], rtol=1e-4, atol=1e-4)
    return batched


def decode_in_chunks(model, cache, attention_mask, step):
    """Decode ``step`` ``[batch, 3]`` after a prefilled ``cache``: first as one 3-token chunk, then
    as two single tokens. Returns each chunk's logits; ``cache`` is extended in place."""
    mask = attention_mask
    logits = []
    for chunk in (step, step[:, :1], step[:, 1:2]):
        mask = torch.cat([mask, torch.ones_like(chunk)], dim=-1)
        positions = position_ids_from_mask(mask)[:, -chunk.shape[1] :]
        with torch.no_grad():
            logits.append(model(chunk, attention_mask=mask, position_ids=positions, **with_cache(cache)).logits)
    return logits


def registered_methods(*, uniform: bool = False, splittable: bool = False, keeps_inputs: bool = False,
                       compresses_first_layer: bool = False) -> list[str]:
    """The registered ``--method`` names a per-method test matrix runs (read from the registry,
    so a new method joins every matrix): those that evict and build from a budget alone
    (a method that needs a file, such as HeadKV's scores, has its own tests; one fitted to a
    model's shape, learned_zip, cannot score the matrices' random layers), filtered by what a
    test assumes of them.

    uniform: every KV head keeps the budget in tokens (no allocation of its own, no summary of the
        evicted tokens that takes slots of the budget, like MomentKV's statistics or IndexMem's memory).
    splittable: the residual cache can split its ranking (not positional, not merging values, not
        summarising the evicted tokens itself).
    keeps_inputs: kept entries are the input keys and values (no merging, no summary entry, no switch
        of the method's that changes them, such as ThinK's channel pruning).
    compresses_first_layer: layer 0 is compressed.
    """
    import warnings

    from restkv import CompressionConfig, ConfigError, available_methods
    from restkv.pipeline.compress import Summariser

    chosen = []
    for name in available_methods():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = CompressionConfig(method=name, max_capacity_prompts=64, window_size=8)
                policy = config.policy
        except ConfigError:
            continue
        summarises = any(isinstance(part, Summariser) for part in config.parts)
        merges = config.merger is not None
        if not policy.evicts or policy.fitted_to_a_model or (uniform and (policy.allocation is not None or summarises)):
            continue
        if splittable and (policy.ranks_by_position or merges or summarises):
            continue
        changes = merges or summarises or any(getattr(part, "changes_entries", False) for part in config.switches)
        if (keeps_inputs and changes) or (compresses_first_layer and not policy.compresses_layer(0)):
            continue
        chosen.append(name)
    return chosen


def surrogate_file(path, layers=3, hidden=64, kv_heads=2, mlp=True, seed=0):
    """A KVzap surrogates file (random, seeded) for the tiny models: a two-layer MLP per layer, or linear."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        if mlp:
            tensors[f"layers.{layer}.0.weight"] = torch.randn(16, hidden, generator=generator)
            tensors[f"layers.{layer}.0.bias"] = torch.randn(16, generator=generator)
            tensors[f"layers.{layer}.2.weight"] = torch.randn(kv_heads, 16, generator=generator)
            tensors[f"layers.{layer}.2.bias"] = torch.randn(kv_heads, generator=generator)
        else:
            tensors[f"layers.{layer}.weight"] = torch.randn(kv_heads, hidden, generator=generator)
            tensors[f"layers.{layer}.bias"] = torch.randn(kv_heads, generator=generator)
    save_file(tensors, str(path))
    return str(path), tensors
