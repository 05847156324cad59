"""Query-aware and query-agnostic generation through the same patched model.

* Query-aware: the question is part of the prompt, so the observation window sees it;
  a plain ``model.generate(prompt_ids)`` compresses after the prefill.
* Query-agnostic (prefix reuse): ``prefill`` compresses the context alone, then
  ``generate_after_context`` feeds the question as new tokens that attend to the
  compressed cache; nothing is compressed a second time.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from restkv.compat import with_cache


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting real tokens only (what ``generate`` uses), so padding does not shift RoPE."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> DynamicCache:
    """Run a (left-padded) prompt through the model once; returns its (compressed) cache."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    cache = DynamicCache(config=model.config)
    model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=True,
        logits_to_keep=1,
        **with_cache(cache),
    )
    return cache


@torch.no_grad()
def generate_after_context(
    model,
    context_ids: torch.Tensor,
    question_ids: torch.Tensor,
    context_mask: torch.Tensor | None = None,
    question_mask: torch.Tensor | None = None,
    return_cache: bool = False,
    **generate_kwargs,
) -> torch.Tensor | tuple[torch.Tensor, DynamicCache]:
    """Query-agnostic generation: compress ``context_ids`` alone, then answer ``question_ids``.

    Both parts may be left-padded (rows of different lengths); the returned ids are the
    generated tokens only, ``[B, new]``. ``return_cache=True`` also returns the cache, so a
    caller can check what it holds (``restkv.cache.cache_report``).
    """
    if context_mask is None:
        context_mask = torch.ones_like(context_ids)
    if question_mask is None:
        question_mask = torch.ones_like(question_ids)
    cache = prefill(model, context_ids, context_mask)
    input_ids = torch.cat([context_ids, question_ids], dim=-1)
    attention_mask = torch.cat([context_mask, question_mask], dim=-1)
    output = model.generate(input_ids=input_ids, attention_mask=attention_mask, **with_cache(cache), **generate_kwargs)
    sequences = output.sequences if hasattr(output, "sequences") else output
    new_tokens = sequences[:, input_ids.shape[-1] :]
    return (new_tokens, cache) if return_cache else new_tokens
