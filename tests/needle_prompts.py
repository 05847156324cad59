"""A small needle-in-a-haystack prompt for the embedded-model tests."""

from __future__ import annotations

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)


def needle_chat_prompt(tokenizer, haystack_tokens: int, depth: float, number: str = "6433012") -> str:
    """A chat prompt whose haystack hides one magic number at ``depth`` (0 = start, 1 = end)."""
    needle = f" The special magic number is {number}. "
    filler_tokens = len(tokenizer(FILLER, add_special_tokens=False).input_ids)
    repeats = max(1, haystack_tokens // filler_tokens)
    pieces = [FILLER] * repeats
    pieces.insert(int(depth * repeats), needle)
    question = "What is the special magic number mentioned in the text above? Answer with the number only."
    messages = [{"role": "user", "content": "".join(pieces) + "\n\n" + question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
