"""From a ``Sample`` to token ids: middle truncation, the chat template, the question split,
the stop tokens.

**Prompt length.** The tokenised prompt (``context + question``, special tokens added) is
cut in the middle to ``--model_max_len`` tokens: the first and last ``model_max_len // 2``
tokens are decoded (special tokens skipped), joined, and the chat wrapper is applied after,
as LongBench's pred.py does.

**Chat and split.** ``chat`` wraps the prompt in the tokenizer's chat template (one user
turn), when it has one; ``answer_prefix`` is appended after that wrapper (it starts the
assistant's turn). Query-aware (default), the whole prompt is prefilled and compressed;
``--query_agnostic`` tokenises ``context`` apart, to be compressed alone before the question.
A multi-question sample's prompts (``encode_questions``) share one context: cut, if too long,
to leave room for its longest question.

**Stopping.** Every EOS id of the model's generation config and tokenizer, plus the last token
of each ``Sample.stop_tokens`` text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from restkv.benchmarks.benchmark import Sample
from restkv.benchmarks.errors import FlagError

#: Placed between context and question inside the chat template, to find the split point.
_SPLIT_MARK = "\ue000restkv-question\ue000"


@dataclass(frozen=True)
class EncodedPrompt:
    """Token ids of one prompt: ``context_ids`` are prefilled (and compressed) first, then
    ``question_ids`` (empty in query-aware mode, where the whole prompt is ``context_ids``)."""

    context_ids: list[int]
    question_ids: list[int]
    truncated: bool

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


def encode_prompt(tokenizer, sample: Sample, max_tokens: int, split: bool = False) -> EncodedPrompt:
    """Truncate, wrap and tokenise ``sample``; ``split`` separates the question (query-agnostic)."""
    head, tail, truncated = truncate_middle(tokenizer, sample.context + sample.question, max_tokens)
    text = head + tail
    # Where the question starts in the kept text; a question longer than the kept tail was cut
    # itself, and then the kept tail plays the question's part.
    if not truncated or (text.endswith(sample.question) and len(sample.question) <= len(tail)):
        context, question = text[: len(text) - len(sample.question)], sample.question
    else:
        context, question = head, tail
    if not split:
        use_chat = sample.chat and getattr(tokenizer, "chat_template", None)
        wrapped = chat_wrap(tokenizer, text, use_chat)
        return EncodedPrompt(_tokens(tokenizer, wrapped + sample.answer_prefix, not use_chat), [], truncated)
    return _encode_split(tokenizer, sample.chat, context, question, sample.answer_prefix, truncated)


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
    """Context and question tokenised apart, the chat wrapper around both."""
    if chat and getattr(tokenizer, "chat_template", None):
        before, after = chat_wrap(tokenizer, context + _SPLIT_MARK + question).split(_SPLIT_MARK)
        return EncodedPrompt(_tokens(tokenizer, before, False), _tokens(tokenizer, after + answer_prefix, False),
                             truncated)
    return EncodedPrompt(_tokens(tokenizer, context, True), _tokens(tokenizer, question + answer_prefix, False),
                         truncated)


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
