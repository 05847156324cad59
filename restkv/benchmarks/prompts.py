"""From a ``Sample`` to token ids: middle truncation, the chat template, the question split,
the stop tokens.

**Prompt length.** The tokenised prompt (``context + question``, special tokens added) is
cut in the middle to ``--model_max_len`` tokens: the first and last ``model_max_len // 2``
tokens are decoded (special tokens skipped), joined, and the chat wrapper is applied after,
as LongBench's pred.py does.

**Chat and split.** ``chat`` wraps the prompt in the tokenizer's chat template (one user
turn), when it has one; ``answer_prefix`` is appended after that wrapper (it starts the
assistant's turn). The pieces are tokenised apart, as KVzip's reference does: the template's
opening (or the tokenizer's own leading special tokens), the context, then the question with
the template's closing, so ``EncodedPrompt.context_span`` says exactly where the context lies.
Query-aware (default), the whole prompt is prefilled and compressed (for a method that finds its
window from a delimiter, ``--finch_delimiter ID``, with ``ID`` between the context and the question:
the question with the template's closing is the window); ``--query_agnostic``
prefills the opening and the context, to be compressed alone before the question. A
multi-question sample's prompts (``encode_questions``) share one context: cut, if too long, to
leave room for its longest question.

**Stopping.** Every EOS id of the model's generation config and tokenizer, plus the last token
of each ``Sample.stop_tokens`` text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from restkv.benchmarks.benchmark import Sample
from restkv.benchmarks.errors import FlagError

#: Placed before the context and between context and question inside the chat template, to find them.
_SPLIT_MARK = "\ue000restkv-question\ue000"


@dataclass(frozen=True)
class EncodedPrompt:
    """Token ids of one prompt: ``context_ids`` are prefilled (and compressed) first, then
    ``question_ids`` (empty in query-aware mode, where the whole prompt is ``context_ids``).
    ``context_span``: ``(start, stop)``, the sample's context within ``context_ids``, after the
    chat template's opening (system prompt, user header, BOS) and, query-aware, before the
    question (what KVzip's reconstruction repeats and the template around it)."""

    context_ids: list[int]
    question_ids: list[int]
    truncated: bool
    context_span: tuple[int, int]

    @property
    def num_tokens(self) -> int:
        return len(self.context_ids) + len(self.question_ids)


def truncate_middle(tokenizer, text: str, max_tokens: int) -> tuple[str, str, bool]:
    """LongBench's rule: over ``max_tokens`` tokens (special tokens included), keep the first
    and last ``max_tokens // 2``, each decoded without special tokens.

    Returns ``(head, tail, truncated)`` with ``head + tail`` the kept text (``tail`` empty
    when nothing was cut).
    """
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2 (one token at each end); got {max_tokens}")
    ids = tokenizer(text, add_special_tokens=True).input_ids
    if len(ids) <= max_tokens:
        return text, "", False
    half = int(max_tokens / 2)
    head = tokenizer.decode(ids[:half], skip_special_tokens=True)
    tail = tokenizer.decode(ids[-half:], skip_special_tokens=True)
    return head, tail, True


def chat_wrap(tokenizer, text: str, use_chat_template: bool = True) -> str:
    """``text`` as the user turn of the tokenizer's chat template, ready for the answer.

    Tokenizers without a chat template (base models) get ``text`` unchanged.
    """
    if not use_chat_template or not getattr(tokenizer, "chat_template", None):
        return text
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )


def encode_prompt(tokenizer, sample: Sample, max_tokens: int, split: bool = False,
                  delimiter: int | None = None) -> EncodedPrompt:
    """Truncate, wrap and tokenise ``sample``; ``split`` separates the question (query-agnostic); ``delimiter``
    (query-aware): the token put between the context and the question (with the template's closing), where a
    method finds its window from it (``--finch_delimiter``)."""
    head, tail, truncated = truncate_middle(tokenizer, sample.context + sample.question, max_tokens)
    text = head + tail
    # Where the question starts in the kept text; a question longer than the kept tail was cut
    # itself, and then the kept tail plays the question's part.
    if not truncated or (text.endswith(sample.question) and len(sample.question) <= len(tail)):
        context, question = text[: len(text) - len(sample.question)], sample.question
    else:
        context, question = head, tail
    encoded = _encode_split(tokenizer, sample.chat, context, question, sample.answer_prefix, truncated)
    if split:
        return encoded
    between = [] if delimiter is None else [delimiter]
    return EncodedPrompt(encoded.context_ids + between + encoded.question_ids, [], truncated, encoded.context_span)


def encode_questions(tokenizer, sample: Sample, max_tokens: int) -> list[EncodedPrompt]:
    """A multi-question sample's prompts, one per question, all with the same context ids.

    Each is what ``encode_prompt(..., split=True)`` gives for that question alone, except that
    a context too long is cut in the middle to leave room for the longest question (never cut),
    so that every question follows the one compressed context.
    """
    longest = max(len(_tokens(tokenizer, question.text, False)) for question in sample.questions)
    if max_tokens - longest < 2:
        raise FlagError(f"--model_max_len {max_tokens} leaves no room for the context of sample {sample.id!r}, "
                        f"whose longest question has {longest} tokens")
    head, tail, truncated = truncate_middle(tokenizer, sample.context, max_tokens - longest)
    return [_encode_split(tokenizer, sample.chat, head + tail, question.text, question.answer_prefix, truncated)
            for question in sample.questions]


def _encode_split(tokenizer, chat: bool, context: str, question: str, answer_prefix: str,
                  truncated: bool) -> EncodedPrompt:
    """Opening, context and question (with the closing and ``answer_prefix``) tokenised apart,
    the chat wrapper around them; the first two are the context ids."""
    if chat and getattr(tokenizer, "chat_template", None):
        wrapped = chat_wrap(tokenizer, _SPLIT_MARK + context + _SPLIT_MARK + question)
        opening, context, after = wrapped.split(_SPLIT_MARK)
        opening_ids, context_ids = _tokens(tokenizer, opening, False), _tokens(tokenizer, context, False)
    else:
        after = question
        context_ids = _tokens(tokenizer, context, False)
        opening_ids = _leading_special_tokens(tokenizer, context, context_ids)
    return EncodedPrompt(opening_ids + context_ids, _tokens(tokenizer, after + answer_prefix, False), truncated,
                         (len(opening_ids), len(opening_ids) + len(context_ids)))


def _leading_special_tokens(tokenizer, text: str, own_ids: list[int]) -> list[int]:
    """The special tokens (BOS) the tokenizer puts before ``text``: its ids with special tokens
    up to where its own ids ``own_ids`` begin (none if they do not appear unchanged)."""
    ids = _tokens(tokenizer, text, True)
    start = next((i for i in range(len(ids) - len(own_ids) + 1) if ids[i : i + len(own_ids)] == own_ids), 0)
    return ids[:start]


def _tokens(tokenizer, piece: str, special: bool) -> list[int]:
    return tokenizer(piece, add_special_tokens=special).input_ids if piece else []


def stop_token_ids(model, tokenizer, extra_texts: Iterable[str] = ()) -> list[int]:
    """Every EOS id of the generation config and tokenizer, plus the last token of each extra text."""
    ids: list[int] = []
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids += list(configured) if isinstance(configured, (list, tuple)) else [configured]
    ids.append(tokenizer.eos_token_id)
    for text in extra_texts:
        ids.append(tokenizer.encode(text, add_special_tokens=False)[-1])
    return sorted({int(i) for i in ids if i is not None})
