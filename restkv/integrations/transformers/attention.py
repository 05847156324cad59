"""restkv's seam in a transformers model: the model's forward runs unchanged.

Every decoder whose attention module calls ``cache.update(...)`` and then the function
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)`` chooses is served
the same way; restkv re-implements no projection, norm or RoPE:

* ``recording_forward`` wraps a patched attention class's ``forward``: it notes the step
  (``restkv.integrations.transformers.steps.step_for``: its kind, decided once from the cache layer as it was
  before this forward and the cache's state, the hidden states, the rotary tables) and calls the original
  forward, whose kernel call reaches restkv's backend (``backend``) and so the step.
* ``model_forward`` wraps a patched decoder class's ``forward`` (the original runs unchanged): it switches a model
  of a ``replace_*`` family to restkv's backend at its first forward, and is the one hook for what needs every
  layer's prefill: the layers that wait for it (``deferred``) and chunked prefill, which runs the original once per
  chunk (so a forward hook cannot serve it); and for what must happen before the embedding: a question delimiter
  taken out of the prompt (``question_window``).

Scaling, soft-capping and sliding windows are what the module hands its kernel. Sliding-window
layers (Gemma 2/3, Mistral with ``sliding_window``) already hold at most ``sliding_window - 1``
prompt tokens, so they stay uncompressed unless the budget is smaller than that; when
compressed, only tokens inside the window compete, and kept tokens leave the window as
generation proceeds.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Callable

import torch
from transformers.cache_utils import Cache

from restkv.cache import CompressedLayer, native_layer
from restkv.integrations.transformers.backend import check_backend, use_backend
from restkv.integrations.transformers.capture import CAPTURES
from restkv.integrations.transformers.compat import CACHE_ARGUMENT, output_cache, with_cache
from restkv.integrations.transformers.deferred import finish_prefill
from restkv.integrations.transformers.handles import cache_state, has_class_config, module_config
from restkv.integrations.transformers.question_window import question_forward
from restkv.integrations.transformers.steps import ACTIVE, layer_facts, step_for


def recording_forward(original: Callable) -> Callable:
    """A patched attention class's ``forward``: ``original`` with its step noted for the dispatcher
    (a module with no config, of a model ``compression`` did not name, runs ``original`` alone)."""
    signature = inspect.signature(original)

    def forward(self, *args, **kwargs):
        config = module_config(self)
        if config is None or self in CAPTURES:  # attention_inputs runs the forward only to its kernel: no step
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
            cache.layers[self.layer_idx] = layer = native_layer(layer_facts(self).sliding_window)
        ACTIVE[self] = step_for(config, cache, layer, hidden_states, arguments.get("position_embeddings"))
        try:
            return original(self, *args, **kwargs)
        finally:
            del ACTIVE[self]

    forward.__wrapped__ = original
    return forward


def patched_attention_of(decoder: torch.nn.Module) -> torch.nn.Module | None:
    """The first attention module of a decoder's layers whose class is patched (a hybrid model's first
    layer may be a Mamba block), or None."""
    return next((module for module in decoder.layers.modules() if has_class_config(type(module))), None)


def model_forward(original: Callable) -> Callable:
    """The patched forward of a decoder model (``LlamaModel``...): ``original``, then the
    compression of layers that waited for the whole prefill (``restkv.integrations.transformers.deferred``)."""

    def forward(self, *args, **kwargs):
        attention = patched_attention_of(self)
        config = module_config(attention) if attention is not None else None
        if config is not None:  # replace_*'s models switch lazily
            use_backend(self)
        if config is None or config.policy.question_delimiter is None:
            return _forward_once(original, self, args, kwargs)
        return question_forward(functools.partial(_forward_once, original, self, ()), self, config,
                                _keywords(original, self, args, kwargs))

    return forward


def _keywords(original: Callable, decoder, args: tuple, kwargs: dict) -> dict:
    """A decoder forward's arguments by name (its ``**kwargs`` spread among them)."""
    if not args:
        return dict(kwargs)
    signature = inspect.signature(original)
    named = {}
    for name, value in list(signature.bind(decoder, *args, **kwargs).arguments.items())[1:]:
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    return named


def _forward_once(original: Callable, self, args: tuple, kwargs: dict):
    """The decoder's forward (in chunks under ``--prefill_chunk_size``), then the layers that waited for it."""
    chunk = _prefill_chunk(self, args, kwargs)
    output = original(self, *args, **kwargs) if chunk is None else _chunked_prefill(original, self, chunk, kwargs)
    cache = kwargs.get(CACHE_ARGUMENT, kwargs.get("past_key_values")) or output_cache(output)
    pending = cache_state(cache).pending if cache is not None else None
    if pending is not None and not pending.observing:
        pending.context_ids = kwargs.get("input_ids", args[0] if args else None)
        finish_prefill(original, self, cache)
    return output


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
            pending = cache_state(cache).pending
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



def _cache_layer(cache: Cache | None, layer_idx: int):
    """The cache's layer ``layer_idx`` (created if the cache grows lazily); None without a cache."""
    if cache is None:
        return None
    if getattr(cache, "layer_class_to_replicate", None) is not None:
        while len(cache.layers) <= layer_idx:
            cache.layers.append(cache.layer_class_to_replicate())
    return cache.layers[layer_idx]
