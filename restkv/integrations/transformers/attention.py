"""restkv's attention, through transformers' own seams: the model's forward runs unchanged.

Every decoder whose attention module calls ``cache.update(...)`` and then the function
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)`` chooses is served
the same way; restkv re-implements no projection, norm or RoPE:

* ``recording_forward`` wraps a patched attention class's ``forward``: it notes the step
  (the cache layer as it was before this forward, the hidden states, the rotary tables) and
  calls the original forward.
* ``install_dispatchers`` registers restkv's dispatcher under the names ``eager``, ``sdpa``,
  ``flash_attention_2`` (and the other kernels transformers has) with ``AttentionInterface``.
  A module with no step noted (an unpatched family, a model outside restkv) goes straight to
  the function the name meant before; a noted step goes to ``restkv_attention``, which gets the
  module's post-RoPE queries, keys and values and the model's own kernel for the native parts:

  * **Compressing prefill** (the first forward into an empty cache layer whose plan,
    ``restkv.pipeline.plan.plan_layer``, evicts something): the output comes from the model's own
    kernel over the full prompt, exactly as unpatched; then ``restkv.pipeline.compress.compress_layer``
    selects what to keep and a ``CompressedLayer`` built from it replaces the cache layer.
  * **Attention over the compressed segments** (decode steps, a prompt's later chunks, a
    question fed after a context-only compression): ``CompressedLayer.update`` leaves the new
    tokens to restkv (``reader_appends``) and ``CompressedLayer.attend`` appends them and
    attends over every segment in one softmax.
  * **Native** otherwise (a budget at or above the prompt, ``fullkv``, layers a method skips).

* ``model_forward`` wraps a patched decoder class's ``forward`` (the original runs unchanged): the
  one hook for what needs every layer's prefill, the layers that wait for it (``restkv.integrations.transformers.deferred``)
  and chunked prefill, which runs the original once per chunk (so a forward hook cannot serve it).
* ``layer_rotary`` probes, once per module, how its own forward turns keys (``rotate_half`` RoPE,
  none, or another rotation) and gives scorers the tables ``restkv.scoring.rope`` turns that layer with.

Scaling, soft-capping and sliding windows are what the module hands its kernel. Sliding-window
layers (Gemma 2/3, Mistral with ``sliding_window``) already hold at most ``sliding_window - 1``
prompt tokens, so they stay uncompressed unless the budget is smaller than that; when
compressed, only tokens inside the window compete, and kept tokens leave the window as
generation proceeds.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable
from weakref import WeakKeyDictionary

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from restkv.cache import CompressedLayer, native_layer
from restkv.config.options import ConfigError
from restkv.integrations.transformers.compat import CACHE_ARGUMENT, output_cache, with_cache
from restkv.integrations.transformers.context_span import protected_span
from restkv.integrations.transformers.deferred import (PendingLayer, chunk_budgets, chunked_prompt, defer_layer,
                                                       finish_prefill, kept_hidden, observe_chunk, observe_held_chunk,
                                                       pending_of, query_weights, trailing_queries)
from restkv.integrations.transformers.handles import (cache_state, forget_switched, has_class_config, module_config,
                                                      note_switched)
from restkv.integrations.transformers.seams import UnsupportedModel, derives_values
from restkv.pipeline.compress import compress_layer, exact_tokens_only_conflicts, prunes_fitting_layers
from restkv.pipeline.plan import LayerPlan, ScoringContext, plan_layer, valid_from_mask
from restkv.pipeline.recompress import recompress
from restkv.scoring.rope import rotate


@dataclass(frozen=True)
class LayerParams:
    """The attention parameters of one layer: what the module hands its kernel, else its own attributes."""

    scaling: float
    softcap: float | None
    sliding_window: int | None

    @classmethod
    def of(cls, module: torch.nn.Module, kernel_kwargs: dict | None = None) -> "LayerParams":
        kernel_kwargs = kernel_kwargs or {}
        if "sliding_window" in kernel_kwargs:
            window = kernel_kwargs["sliding_window"]
        elif hasattr(module, "sliding_window"):
            window = module.sliding_window
        else:  # Mistral applies config.sliding_window to every layer
            window = getattr(module.config, "sliding_window", None)
        softcap = kernel_kwargs.get("softcap", getattr(module, "attn_logit_softcapping", None))
        return cls(kernel_kwargs.get("scaling", module.scaling), softcap, window)


# ---------------------------------------------------------------- the step a patched module is running
@dataclass
class Step:
    """What ``restkv_attention`` needs beyond the kernel's arguments, noted as the module's forward starts."""

    cache: Cache | None
    #: the cache layer as it was before this forward (None without a cache)
    layer: Any
    #: the layer held no token before this forward: a prefill
    prefill: bool
    hidden_states: torch.Tensor
    position_embeddings: Any
    config: Any
    #: the kernel calls the module made so far this step (DiffLlama calls it twice)
    calls: int = 0


#: attention module -> the step its forward is running (only while it runs)
_STEPS: dict[torch.nn.Module, Step] = {}
#: attention module -> what ``attention_inputs`` captures (only while it runs)
_CAPTURES: dict[torch.nn.Module, list] = {}


def recording_forward(original: Callable) -> Callable:
    """A patched attention class's ``forward``: ``original`` with its step noted for the dispatcher
    (a module with no config, of a model ``compression`` did not name, runs ``original`` alone)."""
    signature = inspect.signature(original)

    def forward(self, *args, **kwargs):
        config = module_config(self)
        if config is None or self in _CAPTURES:  # attention_inputs runs the forward only to its kernel: no step
            return original(self, *args, **kwargs)
        check_backend(self.config._attn_implementation)
        arguments = kwargs if len(args) <= 1 else signature.bind_partial(self, *args, **kwargs).arguments
        hidden_states = arguments["hidden_states"] if "hidden_states" in arguments else args[0]
        cache = arguments.get(CACHE_ARGUMENT, arguments.get("past_key_values"))
        if cache is None and config.policy.evicts:
            warnings.warn("restkv: this forward has no cache (use_cache=False), so nothing is compressed: it runs "
                          "the full attention", UserWarning, stacklevel=2)
        layer = _cache_layer(cache, self.layer_idx)
        if isinstance(layer, CompressedLayer) and layer.tokens_seen == 0:  # reset: a new prompt starts native
            cache.layers[self.layer_idx] = layer = native_layer(LayerParams.of(self).sliding_window)
        _STEPS[self] = Step(cache, layer, layer is not None and layer.get_seq_length() == 0, hidden_states,
                            arguments.get("position_embeddings"), config)
        try:
            return original(self, *args, **kwargs)
        finally:
            del _STEPS[self]

    forward.__wrapped__ = original
    return forward


def patched_attention_of(decoder: torch.nn.Module) -> torch.nn.Module | None:
    """The first attention module of a decoder's layers whose class is patched (a hybrid model's first
    layer may be a Mamba block), or None."""
    return next((module for module in decoder.layers.modules() if has_class_config(type(module))), None)


def output_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """The ``[D, H * d]`` weight of a module's output projection: ``o_proj``'s, or that of the one linear
    layer it wraps (Moshi's ``MoshiLinear``); None when it has no single weight matrix."""
    projection = getattr(module, "o_proj", None)
    if isinstance(projection, torch.nn.Linear):
        return projection.weight
    inner = [child for child in projection.modules() if isinstance(child, torch.nn.Linear)] if projection else []
    return inner[0].weight if len(inner) == 1 else None


# ---------------------------------------------------------------- the registered dispatcher
#: the attention implementations restkv serves: its dispatcher is registered under each that transformers has
#: (the native kernel runs the prefill; restkv reads compressed layers itself)
SERVED_KERNELS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")
#: restkv's backend for implementation ``name`` is registered as ``restkv_<name>``
BACKEND_PREFIX = "restkv_"
#: attention class -> its family's eager function
_FAMILY_EAGER: dict[type, Callable] = {}


def backend_name(implementation: str) -> str:
    """The name of restkv's backend over a native attention implementation (``sdpa`` -> ``restkv_sdpa``)."""
    return implementation if implementation.startswith(BACKEND_PREFIX) else BACKEND_PREFIX + implementation


def native_name(implementation: str) -> str:
    """The native implementation a backend name runs (``restkv_sdpa`` -> ``sdpa``)."""
    return implementation.removeprefix(BACKEND_PREFIX)


def register_backends() -> None:
    """Register restkv's attention backend with transformers' public interfaces, once, as ``restkv_<name>`` for
    each implementation it serves that this transformers has (with that implementation's mask function). A model
    runs it once switched with ``set_attn_implementation`` (``restkv.integrations.transformers.patching``); the
    built-in names stay transformers' own, so every other model is untouched."""
    for name in SERVED_KERNELS:
        if backend_name(name) in ALL_ATTENTION_FUNCTIONS.valid_keys() or \
                (name != "eager" and name not in ALL_ATTENTION_FUNCTIONS.valid_keys()):
            continue
        AttentionInterface.register(backend_name(name), _dispatcher(name))
        AttentionMaskInterface.register(backend_name(name), ALL_MASK_ATTENTION_FUNCTIONS[name])


def check_served(implementation: str) -> None:
    """Refuse an attention implementation restkv does not serve (flex attention, a user's own)."""
    if native_name(implementation) not in SERVED_KERNELS:
        raise UnsupportedModel(f"restkv serves the {', '.join(SERVED_KERNELS)} attention implementations; this model "
                               f"uses {implementation!r} (load it with attn_implementation='sdpa')")


def check_backend(implementation: str) -> None:
    """Refuse a configured attention that would not reach restkv's backend: an implementation restkv does not
    serve, or a served one the model was not switched from (its decoder's forward, ``restkv.compression``,
    ``configure`` and ``replace_for_model`` switch it)."""
    check_served(implementation)
    if not implementation.startswith(BACKEND_PREFIX):
        raise UnsupportedModel(f"this attention runs {implementation!r}, not restkv's backend {backend_name(implementation)!r}: "
                               "run it through its model (restkv.compression(model, ...) switches it)")


def use_backend(decoder: torch.nn.Module) -> None:
    """Switch a decoder model (a ``PreTrainedModel`` whose ``layers`` hold patched attention) to restkv's backend
    over its implementation, with transformers' ``set_attn_implementation``; idempotent. ``use_native`` undoes it."""
    current = decoder.config._attn_implementation
    if current.startswith(BACKEND_PREFIX):
        return
    check_served(current)
    decoder.set_attn_implementation(backend_name(current))
    note_switched(decoder, current)


def use_native(decoder: torch.nn.Module) -> None:
    """Give a decoder model back the implementation it ran before ``use_backend`` (nothing if not switched)."""
    native = forget_switched(decoder)
    if native is not None:
        decoder.set_attn_implementation(native)


def native_kernel(name: str, module: torch.nn.Module) -> Callable:
    """The native function of implementation ``name`` for ``module``: eager is the family's own."""
    native = ALL_ATTENTION_FUNCTIONS.get(name) if name != "eager" else None
    if native is not None:
        return native
    cls = type(module)
    if cls not in _FAMILY_EAGER:
        eager = getattr(sys.modules[cls.__module__], "eager_attention_forward", None)
        if eager is None:
            raise ValueError(f"restkv: {cls.__name__} has no eager_attention_forward; use attn_implementation='sdpa'")
        _FAMILY_EAGER[cls] = eager
    return _FAMILY_EAGER[cls]


def _dispatcher(name: str) -> Callable:
    """restkv's backend over native implementation ``name``: a noted step goes to ``restkv_attention``,
    anything else (a module of an unconfigured model, a vision tower) to the native kernel."""

    def dispatch(module, query, key, value, attention_mask, **kwargs):
        captured = _CAPTURES.get(module)
        if captured is not None:
            captured.extend((query, key, value))
            raise _Captured
        native = native_kernel(name, module)
        step = _STEPS.get(module)
        if step is None:
            return native(module, query, key, value, attention_mask, **kwargs)
        return restkv_attention(module, step, native, query, key, value, attention_mask, kwargs)

    dispatch.__name__ = dispatch.__qualname__ = backend_name(name)
    return dispatch


class _Captured(Exception):
    """Ends a module's forward once its kernel's inputs are captured (``attention_inputs``)."""


def attention_inputs(module: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings):
    """Post-RoPE ``query [B, H, N, d]``, ``key``, ``value [B, H_kv, N, d]`` of an attention module, as its
    own forward hands them to its kernel (its projections, norms and RoPE with ``position_embeddings``);
    no cache, nothing after the kernel runs."""
    implementation = module.config._attn_implementation
    captured = _CAPTURES[module] = []
    module.config._attn_implementation = backend_name(implementation)  # the kernel call reaches the backend
    try:
        # forward, not __call__: the module's hooks (a caller's own capture) stay out of it
        module.forward(hidden_states=hidden_states, position_embeddings=position_embeddings, attention_mask=None)
    except _Captured:
        pass
    finally:
        del _CAPTURES[module]
        module.config._attn_implementation = implementation
    if not captured:
        raise ValueError(f"restkv: {type(module).__name__} does not call an attention function of the registry")
    return tuple(captured)


# ---------------------------------------------------------------- the layer's own RoPE
#: attention module -> how its forward turns keys: "rotate_half", "none" or "other" (probed once)
_ROTATIONS: WeakKeyDictionary = WeakKeyDictionary()
#: relative difference below which two probed keys are the same (bfloat16 rounding is ~0.4%)
_PROBE_TOLERANCE = 0.02


def layer_rotary(module: torch.nn.Module, position_embeddings, hidden_states: torch.Tensor, head_dim: int):
    """The ``(cos, sin)`` ``[B, n, head_dim]`` that ``restkv.scoring.rope`` turns this layer's queries and keys with:
    the forward's own tables where the module rotates as ``apply_rotary_pos_emb`` does over every channel,
    the identity where it does not rotate at all (SmolLM3's NoPE layers, Cohere 2's full-attention layers,
    Jamba's attention, which takes no tables), None where it rotates otherwise (interleaved pairs, part of the
    channels, tables it computes itself), which ``restkv.scoring.rope`` cannot undo (``check_pre_rope`` refuses the
    methods that would need it)."""
    kind = _ROTATIONS.get(module)
    if kind is None:
        kind = _ROTATIONS[module] = _probe_rotation(module, position_embeddings, hidden_states)
    if kind == "rotate_half":
        return position_embeddings
    if kind == "none":
        like = position_embeddings[0] if isinstance(position_embeddings, tuple) else hidden_states
        shape = (*like.shape[:2], head_dim)
        return (torch.ones(shape, dtype=like.dtype, device=like.device),
                torch.zeros(shape, dtype=like.dtype, device=like.device))
    return None


def probe_rotations(model: torch.nn.Module, modules: list[torch.nn.Module]) -> dict[torch.nn.Module, str]:
    """How each of ``modules`` turns its keys (``layer_rotary``'s kinds), probed before the model compresses
    anything: one forward of one token, without a cache, hands every module its tables; each module's own
    forward is then probed with them. Empty when the model cannot run that forward (the prefill checks then)."""
    captured: dict[torch.nn.Module, tuple] = {}

    def note(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        captured[module] = (kwargs.get("position_embeddings"), hidden)

    hooks = [module.register_forward_pre_hook(note, with_kwargs=True) for module in modules]
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=model.device), use_cache=False)
    except Exception:
        return {}
    finally:
        for hook in hooks:
            hook.remove()
    for module, (position_embeddings, hidden) in captured.items():
        if module not in _ROTATIONS and hidden is not None:
            _ROTATIONS[module] = _probe_rotation(module, position_embeddings, hidden)
    return {module: _ROTATIONS[module] for module in captured if module in _ROTATIONS}


def _probe_rotation(module: torch.nn.Module, position_embeddings, hidden_states: torch.Tensor) -> str:
    """How ``module`` turns its keys, read from its own forward on one random token: with tables of angle
    0 and of angle 1 on every channel, and compared with ``restkv.scoring.rope.rotate``. A module handed no tables
    rotates nothing unless its forward computes tables itself (from position ids: Moshi)."""
    if not isinstance(position_embeddings, tuple) or len(position_embeddings) != 2:
        source = inspect.getsource(inspect.unwrap(type(module).forward))
        return "other" if "rotary" in source or "position_ids" in source else "none"
    cos = position_embeddings[0]
    generator = torch.Generator().manual_seed(0)
    token = torch.randn(1, 1, hidden_states.shape[-1], generator=generator).to(hidden_states)

    def keys_at(angle: float) -> torch.Tensor:
        tables = tuple(torch.full((1, 1, cos.shape[-1]), value, dtype=cos.dtype, device=cos.device)
                       for value in (math.cos(angle), math.sin(angle)))
        with torch.no_grad():
            return attention_inputs(module, token, tables)[1].float()

    def same(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
        return bool((ours - theirs).norm() <= _PROBE_TOLERANCE * theirs.norm())

    plain, turned = keys_at(0.0), keys_at(1.0)
    if same(plain, turned):
        return "none"
    if cos.shape[-1] == plain.shape[-1]:
        angle = torch.full((1, 1, plain.shape[-1]), 1.0, device=plain.device)
        if same(rotate(plain, angle.cos(), angle.sin()), turned):
            return "rotate_half"
    return "other"


def undoable_rotary(module: torch.nn.Module, position_embeddings, hidden_states: torch.Tensor, head_dim: int):
    """``layer_rotary``, for a reader that cannot do without pre-RoPE queries and keys: a one-line
    ``ConfigError`` (the model cannot serve the reader; commands report it as such) naming the model
    type and layer where the rotation cannot be undone."""
    rotary = layer_rotary(module, position_embeddings, hidden_states, head_dim)
    if rotary is None:
        raise ConfigError(f"no pre-RoPE queries and keys: {_rotation_not_undone(module)}")
    return rotary


def check_pre_rope(module: torch.nn.Module, config) -> None:
    """Refuse a method that reads keys or queries before RoPE on a layer whose rotation ``restkv.scoring.rope``
    cannot undo (``layer_rotary`` gave None), as a ``ConfigError`` (the config and the model do not go
    together): when the config meets the model (``probe_rotations``), or at the prefill of a family
    patched without a model."""
    readers = [flag for part in config.parts for flag in part.pre_rope_flags()]
    if readers:
        raise ConfigError(f"{', '.join(readers)} read{'s' if len(readers) == 1 else ''} keys before RoPE; "
                         f"{_rotation_not_undone(module)}")


def _rotation_not_undone(module: torch.nn.Module) -> str:
    return (f"{module.config.model_type} layer {module.layer_idx} rotates them in a way restkv does not undo "
            "(interleaved channel pairs, part of the channels, or tables its forward computes itself)")


# ---------------------------------------------------------------- restkv's attention
def restkv_attention(module, step: Step, native: Callable, query, key, value, attention_mask, kwargs: dict):
    """The kernel call of a patched module: ``query [B, H, q, d]`` and the ``key``/``value`` its
    ``cache.update`` returned. Returns ``(output [B, q, H, d], weights or None)``."""
    params = LayerParams.of(module, kwargs)
    config, cache, layer, hidden_states = step.config, step.cache, step.layer, step.hidden_states
    call, step.calls = step.calls, step.calls + 1
    pending = pending_of(cache) if cache is not None else None
    weights = None
    if isinstance(layer, CompressedLayer) and layer.value_views is not None:  # each call reads other heads' values
        # the cached keys and values (update's, not the call's), appended once a step
        output = layer.attend(query, *layer.take_incoming(), attention_mask, params.scaling, params.softcap,
                              value_heads=layer.value_views[call])
        return output, None
    if isinstance(layer, CompressedLayer):  # update handed the new tokens on: this read appends them
        rotary = layer_rotary(module, step.position_embeddings, hidden_states, query.shape[-1])
        in_chunks, first = chunked_prompt(cache) is not None, layer.tokens_seen
        output = layer.attend(query, *layer.take_incoming(), attention_mask, params.scaling, params.softcap, rotary,
                              prompt=in_chunks)
        if pending is not None and pending.observing:  # a reconstruction piece of a chunked prompt
            waiting = pending.layers.get(module.layer_idx)
            if waiting is not None and waiting.reconstructed and pending.folding:
                observe_held_chunk(waiting, pending.repeating, query, layer, query_weights(waiting, hidden_states))
        elif in_chunks and config.compresses_after_prefill:  # the chunk waits for the model's (restkv.integrations.transformers.deferred)
            valid = key_validity(attention_mask, query.shape[0], query.shape[2], query.device, empty_rows=True)
            plan = plan_layer(config, valid, module.layer_idx, module.config.num_hidden_layers,
                              budgets=valid.sum(dim=-1).tolist())
            defer_layer(cache, module.layer_idx, PendingLayer(
                config, plan, key, value, trailing_queries(config, query), params.scaling, params.softcap,
                output_weight(module), rotary, first_column=first, hidden=kept_hidden(config, hidden_states),
            ))
        elif config.rescores:
            _compress_again(module, config, cache, layer, query, params)
        return output, None
    output, weights = native(module, query, key, value, attention_mask, **kwargs)
    if pending is not None and pending.observing:  # a reconstruction chunk (restkv.integrations.transformers.deferred)
        waiting = pending.layers.get(module.layer_idx)
        if waiting is not None and waiting.reconstructed and pending.folding:
            observe_chunk(waiting, pending.repeating, query, key, query_weights(waiting, hidden_states))
    elif step.prefill and call > 0:  # a later kernel call of a compressing prefill: only its values are new
        compressed = cache.layers[module.layer_idx]
        if isinstance(compressed, CompressedLayer) and compressed.value_views is not None:
            compressed.value_views.append(value_view(module, layer.values, value))
    elif step.prefill and (plan := _plan_to_compress(module, config, cache, layer, query, attention_mask,
                                                     params)) is not None:
        rotary = layer_rotary(module, step.position_embeddings, hidden_states, query.shape[-1])
        if rotary is None:
            check_pre_rope(module, config)
        views = None
        if derives_values(type(module)):  # one token set for every head; the cached values, read per call
            check_exact_tokens_only(module, config)
            plan, views = dataclasses.replace(plan, shared_heads=True), [value_view(module, layer.values, value)]
            value = layer.values
        if config.compresses_after_prefill:  # the layer waits for the whole prefill (restkv.integrations.transformers.deferred)
            defer_layer(cache, module.layer_idx, PendingLayer(
                config, plan, key, value, trailing_queries(config, query), params.scaling, params.softcap,
                output_weight(module), rotary, hidden=kept_hidden(config, hidden_states),
            ))
        else:
            ctx = ScoringContext.of(query, key, value, plan, params.scaling, params.softcap, output_weight(module),
                                    rotary=rotary, hidden=hidden_states)
            cache.layers[module.layer_idx] = compressed = CompressedLayer.from_state(
                compress_layer(config, ctx), query.shape[2], params.sliding_window, config, plan.padding,
                cache_state(cache).expected_appends)
            compressed.value_views = views
            if config.rescores:
                compressed.remember_queries(query, config.run.window_size)
    return output, weights


def value_view(module: torch.nn.Module, cached: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
    """``[H_kv]`` the KV head of ``cached`` (what ``cache.update`` stored) each head of ``value`` (what the
    module hands its kernel) is, or None when they are the same; refused when a head is none of them."""
    if value is cached or torch.equal(value, cached):
        return None
    heads = []
    for head in range(value.shape[1]):
        match = next((source for source in range(cached.shape[1]) if torch.equal(value[:, head], cached[:, source])),
                     None)
        if match is None:
            raise UnsupportedModel(f"restkv: {type(module).__name__} hands its attention kernel values that are not the "
                             f"cached values of any head (head {head}): a compressed layer cannot read them")
        heads.append(match)
    return torch.tensor(heads, device=value.device)


def check_exact_tokens_only(module: torch.nn.Module, config) -> None:
    """Refuse what a layer that reads each head's values from other heads cannot hold (one exact token set per
    layer, compressed once at the prefill)."""
    conflicts = exact_tokens_only_conflicts(config)
    if conflicts:
        raise ConfigError(f"{', '.join(conflicts)}: {module.config.model_type}'s attention reads each head's values "
                         "from other heads, so restkv keeps one exact token set per layer there, compressed once at "
                         "the prefill")


def model_forward(original: Callable) -> Callable:
    """The patched forward of a decoder model (``LlamaModel``...): ``original``, then the
    compression of layers that waited for the whole prefill (``restkv.integrations.transformers.deferred``)."""

    def forward(self, *args, **kwargs):
        attention = patched_attention_of(self)
        if attention is not None and module_config(attention) is not None:  # replace_*'s models switch lazily
            use_backend(self)
        chunk = _prefill_chunk(self, args, kwargs)
        output = original(self, *args, **kwargs) if chunk is None else _chunked_prefill(original, self, chunk, kwargs)
        cache = kwargs.get(CACHE_ARGUMENT, kwargs.get("past_key_values")) or output_cache(output)
        pending = pending_of(cache) if cache is not None else None
        if pending is not None and not pending.observing:
            pending.context_ids = kwargs.get("input_ids", args[0] if args else None)
            finish_prefill(original, self, cache)
        return output

    return forward


def _prefill_chunk(decoder, args, kwargs) -> int | None:
    """``--prefill_chunk_size`` if this forward is a prefill longer than it, else None."""
    attention = patched_attention_of(decoder)
    config = module_config(attention) if attention is not None else None
    if args or config is None:
        return None
    chunk = config.run.prefill_chunk_size
    tokens = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
    cache = kwargs.get(CACHE_ARGUMENT, kwargs.get("past_key_values"))
    if chunk is None or tokens is None or tokens.shape[1] <= chunk or kwargs.get("use_cache") is False:
        return None
    if cache is not None and cache.get_seq_length() > 0:
        return None
    return chunk


def _chunked_prefill(original: Callable, decoder, chunk: int, kwargs: dict):
    """Run the prompt through ``original`` in chunks of ``chunk`` tokens on one cache; each layer
    compresses again after every chunk (``_compress_again``). Returns the last chunk's output with
    the hidden states of every chunk joined, so ``model(ids)`` gives logits for the whole prompt
    as it does unpatched (``generate`` keeps only the last position's)."""
    from transformers import DynamicCache

    kwargs = dict(kwargs)
    name = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
    tokens = kwargs.pop(name)
    mask, positions = kwargs.pop("attention_mask", None), kwargs.pop("position_ids", None)
    cache = kwargs.pop(CACHE_ARGUMENT, None) or kwargs.pop("past_key_values", None)
    cache = cache if cache is not None else DynamicCache(config=decoder.config)
    if kwargs.get("output_attentions"):
        raise ValueError(f"--prefill_chunk_size {chunk}: output_attentions is not available under chunked prefill "
                         "(each chunk attends to a different cache); run the prompt in one piece to read them")
    rows = (mask.sum(dim=-1) if mask is not None else torch.full((tokens.shape[0],), tokens.shape[1])).tolist()
    outputs, cache_state(cache).chunked_prompt = [], rows
    try:
        for start, stop in chunk_bounds(tokens.shape[1], chunk):
            piece = {name: tokens[:, start:stop], **with_cache(cache)}
            if mask is not None:
                piece["attention_mask"] = mask[:, :stop]
            if positions is not None:
                piece["position_ids"] = positions[:, start:stop]
            outputs.append(original(decoder, **kwargs, **piece))
            pending = pending_of(cache)
            if pending is not None:  # layers that wait for every layer's scores of the chunk
                pending.context_ids = tokens[:, :stop] if name == "input_ids" else None
                finish_prefill(original, decoder, cache)
    finally:
        cache_state(cache).chunked_prompt = None
    decode_budget = module_config(patched_attention_of(decoder)).run.decode_budget
    for layer in cache.layers:  # what ranked the chunks: only a decode budget reads the newest queries again
        if isinstance(layer, CompressedLayer):
            layer.token_scores = None
            if decode_budget is None:
                layer.recent_queries = None
    return _joined_chunks(outputs)


def chunk_bounds(length: int, chunk: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` columns of a prompt's chunks, counted back from its end: the first
    chunk takes the remainder. A left-padded row's chunks then end where the same row's alone do
    (rows are right-aligned), so a batch compresses each row as it would alone."""
    first = length - (length - 1) // chunk * chunk
    return [(0, first)] + [(stop - chunk, stop) for stop in range(first + chunk, length + 1, chunk)]


def _joined_chunks(outputs: list):
    """The last chunk's model output with ``last_hidden_state`` (and ``hidden_states``, when
    asked for) joined over the chunks along the sequence."""
    output = outputs[-1]
    output.last_hidden_state = torch.cat([piece.last_hidden_state for piece in outputs], dim=1)
    if getattr(output, "hidden_states", None) is not None:
        output.hidden_states = tuple(torch.cat(layer, dim=1) for layer in zip(*(piece.hidden_states for piece in outputs)))
    return output



def _compress_again(module, config, cache, layer: CompressedLayer, query, params) -> None:
    """After a prefill chunk, or every ``--decode_interval`` generated tokens: evict again
    (``restkv.pipeline.recompress``) with the newest queries."""
    window = config.run.window_size
    layer.remember_queries(query, window)  # the newest window's queries, across chunk boundaries
    if chunked_prompt(cache) is not None:  # a prompt's later chunk (its first was the prefill)
        budgets = chunk_budgets(config, cache)
        queries = layer.recent_queries
    elif config.run.decode_budget is not None and _due(layer, config.run.decode_budget, config.run.decode_interval):
        budgets = [config.run.decode_budget] * query.shape[0]
        queries = layer.recent_queries
    else:
        return
    if layer.sliding_window is not None:
        raise ValueError(
            f"--prefill_chunk_size and --decode_budget compress full-attention layers again; layer {module.layer_idx} "
            f"has a sliding window of {layer.sliding_window} and a budget below it (raise the budget to the window)"
        )
    recompress(layer, queries, config, budgets, params.scaling, params.softcap, output_weight(module),
               module.layer_idx, module.config.num_hidden_layers)


def _due(layer: CompressedLayer, budget: int, interval: int) -> bool:
    """Decode-time compression runs every ``interval`` new tokens, or sooner if the layer would
    otherwise hold more than ``budget + interval`` entries (a prompt kept above the budget)."""
    held = int((layer.held_counts + layer.summary_slots).max())
    return layer.tail_length >= interval or held > budget + interval


# ---------------------------------------------------------------- prefill
#: the cache layers a compressed one replaces (exactly these: a subclass holds more than keys and values, such
#: as a hybrid model's convolution state or a sparse attention's indexer keys)
COMPRESSIBLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, CompressedLayer)


def _plan_to_compress(module, config, cache, layer, query, attention_mask, params) -> LayerPlan | None:
    """The layer's plan if this prefill evicts something, else None."""
    if not module.is_causal:
        raise ValueError("restkv compresses causal attention only; this model uses bidirectional attention")
    if params.sliding_window is not None and config.run.observation == "reconstruction":
        return None  # as KVzip's reference: only global layers are scored and pruned; a sliding layer keeps its window
    # A chunked prompt's first chunk may be all padding for a shorter row (its chunks end where the row's own do).
    in_chunks = chunked_prompt(cache) is not None
    valid = key_validity(attention_mask, query.shape[0], query.shape[2], query.device, in_chunks)
    budgets, span = None, protected_span(config, cache)
    if in_chunks:  # a sliding-window layer keeps its window whole (the config checked the prompt's budget reaches it)
        budgets = valid.sum(dim=-1).tolist() if params.sliding_window is not None else chunk_budgets(config, cache)
    plan = plan_layer(config, valid, module.layer_idx, module.config.num_hidden_layers, params.sliding_window, budgets,
                      span)
    # A layer compressed again later (chunked prefill, decode budget) is held compressed from the start; ThinK
    # prunes the key channels of a layer that evicts nothing too with --prune_fitting_layers, as its release does.
    owned = config.policy.compresses_layer(module.layer_idx) and (
        (config.rescores and params.sliding_window is None) or prunes_fitting_layers(config))
    if not plan.compress and not owned:
        return None
    if type(layer) not in COMPRESSIBLE_LAYERS or getattr(cache, "offloading", False):
        raise ValueError(
            f"restkv compresses dynamic caches; layer {module.layer_idx} is a {type(layer).__name__}"
            f"{' (offloaded)' if getattr(cache, 'offloading', False) else ''}. Use the default cache "
            "(no cache_implementation, no offloading)"
        )
    return plan


def _cache_layer(cache: Cache | None, layer_idx: int):
    """The cache's layer ``layer_idx`` (created if the cache grows lazily); None without a cache."""
    if cache is None:
        return None
    if getattr(cache, "layer_class_to_replicate", None) is not None:
        while len(cache.layers) <= layer_idx:
            cache.layers.append(cache.layer_class_to_replicate())
    return cache.layers[layer_idx]


def key_validity(attention_mask, batch: int, length: int, device, empty_rows: bool = False) -> torch.Tensor:
    """``[B, N]`` real-token mask of a prefill from whatever mask the attention received.

    4-D masks (eager: additive float, sdpa: bool) mark key ``j`` real iff query ``j`` may see
    it (its diagonal): true for every real token under causal and sliding masks, false for
    padding. flash_attention_2 receives the 2-D padding mask itself; ``None`` means no padding.
    """
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(
            f"restkv supports the eager, sdpa and flash_attention_2 attention implementations; got a "
            f"{type(attention_mask).__name__} mask (flex_attention?)"
        )
    if attention_mask.dim() == 2:
        return valid_from_mask(attention_mask[:, -length:], batch, length, device, empty_rows)
    diagonal = attention_mask[:, 0, -length:, -length:].diagonal(dim1=-2, dim2=-1)
    if diagonal.dtype != torch.bool:
        diagonal = diagonal > torch.finfo(diagonal.dtype).min / 2
    return valid_from_mask(diagonal, batch, length, device, empty_rows)


register_backends()
