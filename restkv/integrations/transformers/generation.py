"""Query-aware and query-agnostic generation through the same patched model.

* Query-aware: the question is part of the prompt, so the observation window sees it;
  a plain ``model.generate(prompt_ids)`` compresses after the prefill.
* Query-agnostic (prefix reuse): ``prefill`` compresses the context alone, then
  ``generate_after_context`` feeds the question as new tokens that attend to the
  compressed cache; nothing is compressed a second time. ``answer_many`` answers several
  questions from one compressed context.
"""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache

from restkv.integrations.transformers.compat import with_cache
from restkv.integrations.transformers.context_span import set_context_span
from restkv.integrations.transformers.handles import cache_state


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting real tokens only (what ``generate`` uses), so padding does not shift RoPE."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


def _check_ids(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, part: str,
               rows: int | None = None) -> None:
    """``input_ids`` of ``part`` ("the context", "question 2") must be ``[batch, tokens]`` with at
    least one token, ``rows`` rows when given (a question continues its context's rows), and a
    mask of the same shape: checked before anything runs, so a bad part is a clear ``ValueError``
    instead of a torch error inside the model (or, for an empty question, a second pass of the
    whole context through the cache)."""
    shape = list(input_ids.shape)
    if input_ids.dim() != 2:
        raise ValueError(f"{part} must be 2-D [batch, tokens]; got input ids of shape {shape}")
    if input_ids.shape[-1] == 0:
        raise ValueError(f"{part} is empty (input ids of shape {shape}); give at least one token")
    if rows is not None and input_ids.shape[0] != rows:
        raise ValueError(f"{part} has {input_ids.shape[0]} rows (input ids of shape {shape}); the context has {rows}")
    if attention_mask is not None and list(attention_mask.shape) != shape:
        raise ValueError(f"{part}'s mask has shape {list(attention_mask.shape)}; its input ids have {shape}")


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
            context_span: tuple[int, int] | None = None) -> DynamicCache:
    """Run a (left-padded) prompt through the model once; returns its (compressed) cache, to inspect
    (``restkv.cache_report``, ``restkv.kept_positions``) or to continue from.

    ``context_span``: where the context lies in each row (``restkv.integrations.transformers.context_span``).
    Example::

        with restkv.compression(model, method="snapkv", max_capacity_prompts=128):
            cache = restkv.prefill(model, input_ids)
        print(restkv.format_report(restkv.cache_report(cache)))
    """
    _check_ids(input_ids, attention_mask, "the prompt")
    return _prefill(model, input_ids, attention_mask, context_span)[0]


def _prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
             context_span: tuple[int, int] | None = None,
             appends: int | None = None) -> tuple[DynamicCache, torch.Tensor]:
    """``prefill`` of checked ids, also returning the logits of the last position ``[B, 1, vocab]``;
    ``appends``: the tokens that will follow (question and answer), when known, so each compressed
    layer holds room for exactly them."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    cache = DynamicCache(config=model.config)
    set_context_span(cache, context_span, int(attention_mask.sum(dim=-1).min()))
    cache_state(cache).expected_appends = appends
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=True,
        logits_to_keep=1,
        **with_cache(cache),
    ).logits
    return cache, logits


@torch.no_grad()
def generate_after_context(
    model,
    context_ids: torch.Tensor,
    question_ids: torch.Tensor,
    context_mask: torch.Tensor | None = None,
    question_mask: torch.Tensor | None = None,
    return_cache: bool = False,
    context_span: tuple[int, int] | None = None,
    **generate_kwargs,
) -> torch.Tensor | tuple[torch.Tensor, DynamicCache]:
    """Query-agnostic generation: compress ``context_ids`` alone, then answer ``question_ids``.

    Both parts may be left-padded (rows of different lengths); the returned ids are the
    generated tokens only, ``[B, new]``. ``return_cache=True`` also returns the cache, so a
    caller can check what it holds (``restkv.cache.cache_report``). ``context_span``: where the
    context lies in ``context_ids`` (``restkv.integrations.transformers.context_span``); a reconstruction
    scorer (KVzip) keeps what lies outside it (the chat template's opening) and repeats the context alone.
    ``generate_kwargs`` go to ``model.generate``. Example::

        context = tokenizer(document, return_tensors="pt").input_ids
        question = tokenizer("\\n\\nWho wrote it?", add_special_tokens=False, return_tensors="pt").input_ids
        with restkv.compression(model, method="kvzip", compression_ratio=0.8):
            answer_ids = restkv.generate_after_context(model, context, question, max_new_tokens=32)
        tokenizer.decode(answer_ids[0], skip_special_tokens=True)

    The ``restkv-text-generation`` pipeline does this with the chat template applied and the span set.
    """
    _check_ids(context_ids, context_mask, "the context")
    _check_ids(question_ids, question_mask, "the question", rows=context_ids.shape[0])
    context_mask = torch.ones_like(context_ids) if context_mask is None else context_mask
    cache = _prefill(model, context_ids, context_mask, context_span,
                     _appends(model, question_ids.shape[-1], generate_kwargs))[0]
    new_tokens = _answer(model, cache, context_ids, context_mask, question_ids, question_mask, generate_kwargs)
    return (new_tokens, cache) if return_cache else new_tokens


@torch.no_grad()
def answer_many(
    model,
    context_ids: torch.Tensor,
    questions: list[torch.Tensor],
    context_mask: torch.Tensor | None = None,
    question_masks: list[torch.Tensor | None] | None = None,
    context_span: tuple[int, int] | None = None,
    **generate_kwargs,
) -> list[torch.Tensor]:
    """One compressed context, many questions: the context is prefilled and compressed once, and
    every question is answered from that same compressed state (the cache is put back after each
    answer, so no question's tokens reach the next). Each answer equals what
    ``generate_after_context`` gives for that question alone, bit for bit. Returns the generated
    ids of every question, ``[B, new]`` each. Example::

        with restkv.compression(model, method="snapkv", max_capacity_prompts=256):
            first, second = restkv.answer_many(model, context_ids, [question_ids, other_question_ids],
                                               max_new_tokens=32)
    """
    _check_ids(context_ids, context_mask, "the context")
    if not questions:
        raise ValueError("answer_many needs at least one question")
    if question_masks is not None and len(question_masks) != len(questions):
        raise ValueError(f"{len(questions)} questions but {len(question_masks)} question masks")
    masks = question_masks if question_masks is not None else [None] * len(questions)
    for index, (question, mask) in enumerate(zip(questions, masks)):
        _check_ids(question, mask, f"question {index}", rows=context_ids.shape[0])
    context_mask = torch.ones_like(context_ids) if context_mask is None else context_mask
    longest = max(question.shape[-1] for question in questions)
    cache = _prefill(model, context_ids, context_mask, context_span, _appends(model, longest, generate_kwargs))[0]
    compressed = [copy.copy(layer) for layer in cache.layers]
    answers = []
    for question, mask in zip(questions, masks):
        cache.layers[:] = [copy.copy(layer) for layer in compressed]
        answers.append(_answer(model, cache, context_ids, context_mask, question, mask, generate_kwargs))
    return answers


def _generation_config(model, generate_kwargs: dict):
    """The generation settings ``model.generate(**generate_kwargs)`` will run with."""
    config = copy.copy(generate_kwargs.get("generation_config") or model.generation_config)
    for name, value in generate_kwargs.items():
        if hasattr(config, name) and name != "generation_config":
            setattr(config, name, value)
    return config


def _appends(model, question_length: int, generate_kwargs: dict) -> int | None:
    """The tokens a context's cache takes after its prefill (the question, then at most ``max_new_tokens``), or
    None when the length is not given."""
    new_tokens = _generation_config(model, generate_kwargs).max_new_tokens
    return None if new_tokens is None else question_length + new_tokens


def _answer(model, cache, context_ids, context_mask, question_ids, question_mask, generate_kwargs) -> torch.Tensor:
    """Generate after ``question_ids`` from a cache that holds the (compressed) context. Beam search and
    several returned sequences run on copies of each row: ``generate`` repeats the inputs it is given,
    not a cache handed to it, so the cache's rows are repeated here the same way."""
    if cache_state(cache).question_columns is not None:
        raise ValueError("--finch_delimiter: the context held the question delimiter, but query-agnostic generation "
                         "compresses the context before the question; give context, delimiter and question as one "
                         "prompt (model.generate)")
    question_mask = torch.ones_like(question_ids) if question_mask is None else question_mask
    input_ids = torch.cat([context_ids, question_ids], dim=-1)
    attention_mask = torch.cat([context_mask, question_mask], dim=-1)
    config = _generation_config(model, generate_kwargs)
    copies = max(config.num_beams or 1, config.num_return_sequences or 1)
    if copies > 1:
        cache.batch_repeat_interleave(copies)
    output = model.generate(input_ids=input_ids, attention_mask=attention_mask, **with_cache(cache), **generate_kwargs)
    sequences = output.sequences if hasattr(output, "sequences") else output
    return sequences[:, input_ids.shape[-1] :]


@torch.no_grad()
def answer_nll(model, prompt_ids: torch.Tensor, answer_ids: torch.Tensor,
               question_ids: torch.Tensor | None = None, context_span: tuple[int, int] | None = None) -> torch.Tensor:
    """Teacher-forced negative log-likelihood of ``answer_ids`` under the compressed cache.

    A continuous quality measure for comparing methods where exact-match scores are too coarse
    (small models, few samples). ``prompt_ids`` ``[1, L]`` is prefilled (and compressed) in one
    pass, so with ``question_ids`` ``[1, Q]`` this is the query-agnostic setting: the question and
    the answer are then fed as new tokens attending to the compressed context. Returns the NLL of
    each answer token, ``[A]`` float32 (natural log).
    """
    _check_ids(prompt_ids, None, "the prompt")
    if prompt_ids.shape[0] != 1 or answer_ids.shape[0] != 1:
        raise ValueError("answer_nll scores one row at a time")
    if answer_ids.shape[-1] == 0:
        raise ValueError("answer_nll needs at least one answer token")
    cache, first = _prefill(model, prompt_ids, None, context_span)
    return continuation_nll(model, cache, first, prompt_ids.shape[-1], answer_ids, question_ids)


@torch.no_grad()
def prefill_with_logits(model, prompt_ids: torch.Tensor, context_span: tuple[int, int] | None = None,
                        appends: int | None = None) -> tuple[DynamicCache, torch.Tensor]:
    """``prefill`` of one unpadded row ``[1, L]``, also returning the logits of its last position ``[1, 1, vocab]``:
    what ``continuation_nll`` and ``greedy_continuation`` read on, so that one compression serves both (a
    benchmark times the compression apart from them). ``appends``: the tokens that will follow, when known."""
    _check_ids(prompt_ids, None, "the prompt")
    if prompt_ids.shape[0] != 1:
        raise ValueError("prefill_with_logits reads one row at a time")
    return _prefill(model, prompt_ids, None, context_span, appends)


@torch.no_grad()
def continuation_nll(model, cache: DynamicCache, last_logits: torch.Tensor, start: int, answer_ids: torch.Tensor,
                     question_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The NLL of each token of ``answer_ids`` ``[1, A]`` after ``question_ids`` ``[1, Q]`` (if any), both fed as
    new tokens from position ``start`` into ``cache`` (which they extend), ``last_logits`` being the prefill's
    last logits. Returns ``[A]`` float32 (natural log)."""
    question = question_ids if question_ids is not None else answer_ids[:, :0]
    rest = torch.cat([question, answer_ids[:, :-1]], dim=-1)
    logits = last_logits
    if rest.shape[-1]:
        logits = torch.cat([last_logits, _extend(model, cache, rest, start)], dim=1)
    predicting = logits[0, question.shape[-1]:].float()  # the logits that predict each answer token
    return torch.nn.functional.cross_entropy(predicting, answer_ids[0], reduction="none")


@torch.no_grad()
def greedy_continuation(model, cache: DynamicCache, last_logits: torch.Tensor, start: int,
                        question_ids: torch.Tensor | None, max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """Greedy answer after ``question_ids`` (if any), fed from position ``start`` into ``cache``: at most
    ``max_new_tokens`` ids, ending at the first of ``stop_ids`` (not included)."""
    logits, position, answer = last_logits, start, []
    if question_ids is not None and question_ids.shape[-1]:
        logits = _extend(model, cache, question_ids, start)
        position += question_ids.shape[-1]
    while len(answer) < max_new_tokens:
        token = int(logits[0, -1].argmax())
        if token in stop_ids:
            break
        answer.append(token)
        logits = _extend(model, cache, torch.tensor([[token]], device=logits.device), position)
        position += 1
    return answer


def _extend(model, cache: DynamicCache, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Feed ``ids`` ``[1, T]`` into ``cache`` at positions ``start`` on; their logits ``[1, T, vocab]``."""
    positions = torch.arange(start, start + ids.shape[-1], device=ids.device)[None]
    return model(input_ids=ids, position_ids=positions, **with_cache(cache)).logits
