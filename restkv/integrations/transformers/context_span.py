"""Where the context lies in a prompt, for reconstruction (KVzip).

KVzip's reference keeps the chat template's opening (system prompt, user header) whatever its
score and repeats only the context when it reconstructs it; in a query-aware prompt the
question and the template's closing after the context are what the answer reads first, so
they are kept too. A caller that knows where the context lies says so on the cache the prompt
is prefilled into (``set_context_span``; the generation helpers take ``context_span=``, the
runners pass what the prompt's builder knows, ``EncodedPrompt.context_span``). Under
``--observation reconstruction``, and for a method that predicts KVzip's ranking without the
repetition (``learned_zip``), every token outside the span is then protected (kept whatever its
score, within the budget) and the repetition is the span alone; without a span the whole prompt
is the context.
"""

from __future__ import annotations

import operator

from restkv.integrations.transformers.handles import cache_state


def set_context_span(cache, span, prompt_length: int | None = None) -> None:
    """Say that the prompt ``cache`` will be prefilled with holds its context at row-local
    positions ``start:stop`` (every row alike: reconstruction compresses one row at a time);
    ``prompt_length``: the real tokens of the shortest row, which the span must lie within."""
    if span is None:
        return
    if isinstance(span, (str, bytes)) or not hasattr(span, "__len__") or len(span) != 2:
        raise ValueError(f"context_span must be a pair (start, stop) of token positions; got {span!r}")
    try:
        start, stop = (operator.index(bound) for bound in span)
    except TypeError:
        raise ValueError(f"context_span must be a pair of integer token positions (start, stop); got {span!r}") \
            from None
    if not 0 <= start < stop:
        raise ValueError(f"context_span {(start, stop)} must be (start, stop) with 0 <= start < stop")
    if prompt_length is not None and stop > prompt_length:
        raise ValueError(f"context_span {(start, stop)} ends after the prompt's {prompt_length} tokens (positions "
                         "count each row's real tokens from 0)")
    cache_state(cache).context_span = (start, stop)


def context_span(cache) -> tuple[int, int] | None:
    """The span ``set_context_span`` gave ``cache``, or None."""
    return cache_state(cache).context_span if cache is not None else None


def protected_span(config, span: tuple[int, int] | None) -> tuple[int, int] | None:
    """The context ``span`` a cache was given (``set_context_span``), where ``config`` keeps its surroundings
    whatever their score (see the module docstring), else None: it does under the reconstruction observation,
    and for a method that ranks the context as KVzip does (``Policy.ranks_context_alone``)."""
    if config.run.observation == "reconstruction" or config.policy.ranks_context_alone:
        return span
    return None
