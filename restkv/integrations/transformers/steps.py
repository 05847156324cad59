"""What restkv does at one kernel call of a patched attention: one named step, chosen once per forward.

A patched attention's forward (``restkv.integrations.transformers.attention.recording_forward``) notes a
``Step`` before the module runs: what kind of step it is, decided once from the cache layer and the cache's
side state (``step_for``), and that state itself (the layers waiting for the whole prefill, the rows of a
prompt read in chunks, the protected context span, the tokens a caller will append). restkv's backend
(``restkv.integrations.transformers.backend``) hands the kernel call to ``run_step``, which runs that kind's
step; no step goes back to the cache's side state:

* ``prefill_layer``: the first forward into an empty cache layer. The output is the model's own kernel over the
  full prompt, exactly as unpatched; if the layer's plan (``restkv.pipeline.plan.plan_layer``) evicts something,
  its ``LayerInputs`` are made once and the layer is compressed now (``restkv.pipeline.compress.compress_layer``,
  then a ``CompressedLayer`` replaces the cache layer) or left for the whole prefill (``deferred``).
* ``read_layer``: a compressed layer (decode steps, a prompt's later chunks, a question fed after a context-only
  compression): the step's new tokens are appended and attended with every segment in one softmax; then, where
  the run asks, the chunk waits for the model's (``deferred``), a reconstruction piece is scored, or the layer is
  compressed again (``restkv.pipeline.recompress``).
* ``observe_layer``: a reconstruction forward over a native layer (KVzip's repetition): the model's own kernel,
  its queries folded into the waiting layer's statistics.
* ``native_layer_step``: anything else (a budget at or above the prompt, ``fullkv``, a forward without a cache).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from restkv.cache import CompressedLayer
from restkv.config.options import ConfigError
from restkv.integrations.transformers.context_span import protected_span
from restkv.integrations.transformers.deferred import (PendingLayer, PendingPrefill, attend_and_observe, chunk_budgets,
                                                       defer_layer, kept_hidden, observe_chunk, observe_held_chunk,
                                                       query_weights, trailing_queries)
from restkv.integrations.transformers.handles import CacheState, cache_state
from restkv.integrations.transformers.rotation import check_pre_rope, layer_rotary
from restkv.integrations.transformers.seams import UnsupportedModel, derives_values
from restkv.pipeline.compress import compress_layer, exact_tokens_only_conflicts, prunes_fitting_layers
from restkv.pipeline.inputs import LayerFacts, LayerInputs
from restkv.pipeline.plan import LayerPlan, plan_layer, valid_from_mask
from restkv.pipeline.recompress import (compress_decoding, compression_due, decode_budgets, evict_below_threshold,
                                        recompress, remember_newest, score_arrivals)


# ---------------------------------------------------------------- a layer's facts
def output_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """The ``[D, H * d]`` weight of a module's output projection: ``o_proj``'s, or that of the one linear
    layer it wraps (Moshi's ``MoshiLinear``); None when it has no single weight matrix."""
    projection = getattr(module, "o_proj", None)
    if isinstance(projection, torch.nn.Linear):
        return projection.weight
    inner = [child for child in projection.modules() if isinstance(child, torch.nn.Linear)] if projection else []
    return inner[0].weight if len(inner) == 1 else None


def layer_facts(module: torch.nn.Module, kernel_kwargs: dict | None = None) -> LayerFacts:
    """What a module's attention is: what it hands its kernel (scale, soft-cap, sliding window), else its own
    attributes (Mistral applies ``config.sliding_window`` to every layer), and its output projection."""
    kernel_kwargs = kernel_kwargs or {}
    if "sliding_window" in kernel_kwargs:
        window = kernel_kwargs["sliding_window"]
    elif hasattr(module, "sliding_window"):
        window = module.sliding_window
    else:
        window = getattr(module.config, "sliding_window", None)
    softcap = kernel_kwargs.get("softcap", getattr(module, "attn_logit_softcapping", None))
    return LayerFacts(kernel_kwargs.get("scaling", module.scaling), softcap, window, output_weight(module))


# ---------------------------------------------------------------- the step
@dataclass
class Step:
    """One forward of a patched attention module: what kind of step it is and the state its step reads,
    noted as the forward starts (``step_for``)."""

    #: ``prefill``, ``read``, ``observe`` or ``native``: the function ``run_step`` runs
    kind: str
    config: Any
    cache: Cache | None
    #: the cache layer as it was before this forward (None without a cache)
    layer: Any
    hidden_states: torch.Tensor
    position_embeddings: Any
    #: the cache's layers waiting for the whole prefill (``restkv.integrations.transformers.deferred``), or None
    pending: PendingPrefill | None
    #: each row's real tokens while the cache reads a prompt in chunks (``--prefill_chunk_size``), else None
    chunk_rows: list[int] | None
    #: the row-local context span whose surroundings are protected (``context_span.protected_span``), or None
    span: tuple[int, int] | None
    #: tokens the caller will append after the prefill (question and answer), when it said so
    appends: int | None
    #: the kernel calls the module made so far this step (DiffLlama calls it twice)
    calls: int = 0

    @property
    def observing(self) -> bool:
        """A reconstruction forward is running (its queries score the waiting layers)."""
        return self.pending is not None and self.pending.observing


def step_for(config, cache: Cache | None, layer, hidden_states: torch.Tensor, position_embeddings) -> Step:
    """The step a patched module's forward runs, decided once from its cache layer and the cache's state."""
    state = cache_state(cache) if cache is not None else CacheState()  # the cache's side state, read once
    pending = state.pending
    if isinstance(layer, CompressedLayer):
        kind = "read"
    elif pending is not None and pending.observing:
        kind = "observe"
    elif layer is not None and layer.get_seq_length() == 0:
        kind = "prefill"
    else:
        kind = "native"
    return Step(kind, config, cache, layer, hidden_states, position_embeddings, pending, state.chunked_prompt,
                protected_span(config, state.context_span), state.expected_appends)


#: attention module -> the step its forward is running (only while it runs)
ACTIVE: dict[torch.nn.Module, Step] = {}


def run_step(module, step: Step, native: Callable, query, key, value, attention_mask, kwargs: dict):
    """The kernel call of a patched module (``query [B, H, q, d]``, the ``key``/``value`` its ``cache.update``
    returned), run as its step's kind. Returns ``(output [B, q, H, d], weights or None)``."""
    call, step.calls = step.calls, step.calls + 1
    facts = layer_facts(module, kwargs)
    return STEPS[step.kind](module, step, call, facts, native, query, key, value, attention_mask, kwargs)


def native_layer_step(module, step, call, facts, native, query, key, value, attention_mask, kwargs):
    """The model's own kernel, nothing more."""
    return native(module, query, key, value, attention_mask, **kwargs)


def observe_layer(module, step, call, facts, native, query, key, value, attention_mask, kwargs):
    """A reconstruction forward over a native layer: the model's own kernel, and its queries folded into the
    waiting layer's statistics (``deferred.observe_chunk``)."""
    waiting = step.pending.layers.get(module.layer_idx)
    if waiting is None or not waiting.reconstructed or not step.pending.folding:
        return native(module, query, key, value, attention_mask, **kwargs)
    weights = query_weights(waiting, step.hidden_states)
    if call == 0 and not derives_values(type(module)):
        output = attend_and_observe(waiting, step.pending.repeating, query, key, value, facts, weights)
        if output is not None:
            return output, None
    output = native(module, query, key, value, attention_mask, **kwargs)
    observe_chunk(waiting, step.pending.repeating, query, key, weights)
    return output


def prefill_layer(module, step, call, facts, native, query, key, value, attention_mask, kwargs):
    """The first forward into an empty layer: the model's own output, then the layer's compression, now or after
    the whole prefill, when its plan evicts something."""
    output = native(module, query, key, value, attention_mask, **kwargs)
    config, cache, layer = step.config, step.cache, step.layer
    if call > 0:  # a later kernel call of a compressing prefill (DiffLlama): only its values are new
        compressed = cache.layers[module.layer_idx]
        if isinstance(compressed, CompressedLayer) and compressed.value_views is not None:
            compressed.value_views.append(value_view(module, layer.values, value))
        return output
    plan = plan_to_compress(module, step, facts, query, attention_mask)
    if plan is None:
        return output
    rotary = layer_rotary(module, step.position_embeddings, step.hidden_states, query.shape[-1])
    if rotary is None:
        check_pre_rope(module, config)
    views = None
    if derives_values(type(module)):  # one token set for every head; the cached values, read per call
        check_exact_tokens_only(module, config)
        plan, views = dataclasses.replace(plan, shared_heads=True), [value_view(module, layer.values, value)]
        value = layer.values
    if config.compresses_after_prefill:  # the layer waits for the whole prefill (deferred)
        inputs = LayerInputs(trailing_queries(config, query), key, value, plan, facts, rotary=rotary,
                             hidden=kept_hidden(config, step.hidden_states))
        defer_layer(cache, module.layer_idx, PendingLayer(config, inputs))
        return output
    inputs = LayerInputs(query, key, value, plan, facts, rotary=rotary, hidden=step.hidden_states)
    decoding = config.decoding
    arrived = decoding.policy.score(inputs).float() if decoding is not None and decoding.scores_on_arrival else None
    cache.layers[module.layer_idx] = compressed = CompressedLayer.from_state(
        compress_layer(config, inputs, scores=arrived if decoding is config else None), query.shape[2],
        facts.sliding_window, config, plan.padding, step.appends)
    if arrived is not None:  # what generation's compressions rank the prompt's kept tokens by
        compressed.token_scores = arrived.gather(2, compressed.kept_columns.long().clamp(min=0))
    compressed.value_views = views
    if config.compresses_again:
        remember_newest(compressed, config, query, rotary)
    return output


def read_layer(module, step, call, facts, native, query, key, value, attention_mask, kwargs):
    """Attention over a compressed layer: the step's new tokens (what ``cache.update`` handed on, appended by the
    step's first read) with every segment in one softmax; then what the run asks of the read."""
    config, layer = step.config, step.layer
    if layer.value_views is not None:  # each call reads other heads' values of the same tokens
        output = layer.attend(query, *layer.take_incoming(), attention_mask, facts.scaling, facts.softcap,
                              value_heads=layer.value_views[call])
        return output, None
    rotary = layer_rotary(module, step.position_embeddings, step.hidden_states, query.shape[-1])
    in_chunks, first = step.chunk_rows is not None, layer.tokens_seen
    output = layer.attend(query, *layer.take_incoming(), attention_mask, facts.scaling, facts.softcap, rotary,
                          prompt=in_chunks)
    if step.observing:  # a reconstruction piece of a chunked prompt
        waiting = step.pending.layers.get(module.layer_idx)
        if waiting is not None and waiting.reconstructed and step.pending.folding:
            observe_held_chunk(waiting, step.pending.repeating, query, layer,
                               query_weights(waiting, step.hidden_states))
    elif in_chunks and config.compresses_after_prefill:  # the chunk waits for the model's (deferred)
        valid = key_validity(attention_mask, query.shape[0], query.shape[2], query.device, empty_rows=True)
        plan = plan_layer(config, valid, module.layer_idx, module.config.num_hidden_layers,
                          budgets=valid.sum(dim=-1).tolist())
        inputs = LayerInputs(trailing_queries(config, query), key, value, plan, facts, rotary=rotary,
                             hidden=kept_hidden(config, step.hidden_states))
        defer_layer(step.cache, module.layer_idx, PendingLayer(config, inputs, first_column=first))
    elif config.compresses_again:
        compress_again(module, step, facts, query, key, value, rotary)
    return output, None


#: the step of each kind (``Step.kind``)
STEPS: dict[str, Callable] = {"prefill": prefill_layer, "read": read_layer, "observe": observe_layer,
                              "native": native_layer_step}


# ---------------------------------------------------------------- recompression
def compress_again(module, step: Step, facts: LayerFacts, query, key, value, rotary) -> None:
    """After a prefill chunk, or every ``--decode_interval`` generated tokens: evict again
    (``restkv.pipeline.recompress``), scored by the newest queries or by the scores each token got as it came."""
    config, layer = step.config, step.layer
    layer_idx, num_layers = module.layer_idx, module.config.num_hidden_layers
    remember_newest(layer, config, query, rotary)  # the newest queries, across chunk boundaries
    if step.chunk_rows is not None:  # a prompt's later chunk (its first was the prefill)
        _check_full_attention(layer, layer_idx, config)
        recent = layer.recent_queries
        recompress(layer, recent[:, :, recent.shape[2] - config.run.window_size:], config,
                   chunk_budgets(config, step.chunk_rows), facts, layer_idx, num_layers)
        return
    decoding = config.decoding
    if decoding is None:  # only the prompt is read in chunks
        return
    run = decoding.run
    if decoding.scores_on_arrival:
        layer.remember_scores(score_arrivals(decoding, layer, query, key, value, facts, layer_idx, num_layers, rotary,
                                             step.hidden_states))
    if not compression_due(layer, query.shape[2], run.decode_interval):
        return
    _check_full_attention(layer, layer_idx, config)
    if run.compresses_decoding:
        compress_decoding(layer, decoding, decode_budgets(decoding, layer), facts, layer_idx, num_layers)
    else:  # DMS's threshold alone (--dms_decoding)
        evict_below_threshold(layer, decoding, decoding.switch("dms").dms_threshold, facts, layer_idx, num_layers)


def _check_full_attention(layer: CompressedLayer, layer_idx: int, config) -> None:
    if layer.sliding_window is not None:
        raise ValueError(
            f"{' and '.join(config.rescoring_flags(every_method=True))} compress full-attention layers again; layer "
            f"{layer_idx} has a sliding window of {layer.sliding_window} and a budget below it (raise the budget to "
            "the window)"
        )


# ---------------------------------------------------------------- prefill
#: the cache layers a compressed one replaces (exactly these: a subclass holds more than keys and values, such
#: as a hybrid model's convolution state or a sparse attention's indexer keys)
COMPRESSIBLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, CompressedLayer)


def plan_to_compress(module, step: Step, facts: LayerFacts, query, attention_mask) -> LayerPlan | None:
    """The layer's plan if this prefill evicts something, else None."""
    config, cache, layer = step.config, step.cache, step.layer
    if not module.is_causal:
        raise ValueError("restkv compresses causal attention only; this model uses bidirectional attention")
    if facts.sliding_window is not None and config.run.observation == "reconstruction":
        return None  # as KVzip's reference: only global layers are scored and pruned; a sliding layer keeps its window
    # A chunked prompt's first chunk may be all padding for a shorter row (its chunks end where the row's own do).
    in_chunks = step.chunk_rows is not None
    valid = key_validity(attention_mask, query.shape[0], query.shape[2], query.device, in_chunks)
    budgets = None
    if in_chunks:  # a sliding-window layer keeps its window whole (the config checked the prompt's budget reaches it)
        budgets = (valid.sum(dim=-1).tolist() if facts.sliding_window is not None
                   else chunk_budgets(config, step.chunk_rows))
    plan = plan_layer(config, valid, module.layer_idx, module.config.num_hidden_layers, facts.sliding_window,
                      budgets, step.span)
    # A layer compressed again later (chunked prefill, decode budget) is held compressed from the start; ThinK
    # prunes the key channels of a layer that evicts nothing too with --prune_fitting_layers, as its release does.
    decoding = config.decoding
    compressed_later = config.compresses_again and facts.sliding_window is None and (
        config.policy.compresses_layer(module.layer_idx)
        or (decoding is not None and decoding.policy.compresses_layer(module.layer_idx)))
    owned = compressed_later or (config.policy.compresses_layer(module.layer_idx) and prunes_fitting_layers(config))
    if not plan.compress and not owned:
        return None
    if type(layer) not in COMPRESSIBLE_LAYERS or getattr(cache, "offloading", False):
        raise ValueError(
            f"restkv compresses dynamic caches; layer {module.layer_idx} is a {type(layer).__name__}"
            f"{' (offloaded)' if getattr(cache, 'offloading', False) else ''}. Use the default cache "
            "(no cache_implementation, no offloading)"
        )
    return plan


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


# ---------------------------------------------------------------- modules that read other heads' values
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
            raise UnsupportedModel(f"restkv: {type(module).__name__} hands its attention kernel values that are not "
                                   f"the cached values of any head (head {head}): a compressed layer cannot read them")
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
