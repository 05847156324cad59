"""The reconstruction prompt: what the model reads before it repeats the context (KVzip).

``--observation reconstruction`` (``restkv.deferred``) scores a context by the attention of the
model repeating it. KVzip's reference (``model/wrapper.py`` ``self_task``, ``model/template.py``)
prefills the chat template's opening (system prompt, user header) and then the context, and
scores it with: the instruction ``"\\n\\nRepeat the previous context exactly."``, continuing the
user turn that holds the context; the template's closing tokens (the end of the user turn and
the assistant's header); then the context alone. So the repetition opens no second turn: no
second system prompt, no second BOS, no repeat of the opening. A tokenizer without a chat
template gets the reference's fallback closing, ``"\\n\\nAnswer: "``.

``set_reconstruction_prompt`` gives the model the ids that precede the repeated context (the
runners call it once per model); ``reconstruction_prefix`` reads them. What is repeated is the
context alone: ``prefilled_ids[start:stop]`` for the span the prompt's builder knows
(``restkv.benchmarks.prompts.EncodedPrompt.context_span``: after the opening, before a
question).
"""

from __future__ import annotations

import warnings

import torch

#: the instruction that starts the reconstruction prompt (KVzip's)
RECONSTRUCTION_INSTRUCTION = "Repeat the previous context exactly."
#: KVzip's closing for a model without a chat template
PLAIN_CLOSING = "\n\nAnswer: "
#: kvpress's KVzipPress closing for a model without a chat template (its parity fixtures replay it)
KVPRESS_CLOSING = "\n"
#: stands for a user message's content while a chat template is rendered
_CONTENT_MARK = "\ue000restkv-content\ue000"


def template_closing(tokenizer) -> str:
    """What the tokenizer's chat template puts after a user message's content when the
    assistant answers next (the end of the turn and the assistant's header); ``PLAIN_CLOSING``
    without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return PLAIN_CLOSING
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": _CONTENT_MARK}], add_generation_prompt=True,
                                             tokenize=False)
    return rendered.split(_CONTENT_MARK)[1]


def set_reconstruction_prompt(model, tokenizer, instruction: str = RECONSTRUCTION_INSTRUCTION,
                              closing: str | None = None) -> torch.Tensor:
    """Give ``model`` the ids that precede the repeated context, ``"\\n\\n" + instruction`` then
    ``closing`` (default ``template_closing``; ``KVPRESS_CLOSING`` reproduces kvpress's KVzipPress),
    each tokenised without special tokens as KVzip's reference does; returns them. Without this
    call the repetition starts with no instruction (and says so once)."""
    instruction_ids = tokenizer(f"\n\n{instruction}", add_special_tokens=False).input_ids
    closing_ids = tokenizer(template_closing(tokenizer) if closing is None else closing,
                            add_special_tokens=False).input_ids
    prefix = torch.tensor(instruction_ids + closing_ids, dtype=torch.long)
    _decoder(model)._restkv_reconstruction_prefix = prefix
    return prefix


def reconstruction_prefix(decoder) -> torch.Tensor:
    """The decoder model's reconstruction prompt ids (empty, with a warning, if none was set)."""
    prefix = getattr(decoder, "_restkv_reconstruction_prefix", None)
    if prefix is None:
        warnings.warn(
            "restkv: --observation reconstruction without a reconstruction prompt: the context is repeated with no "
            "instruction. Call restkv.reconstruction_prompt.set_reconstruction_prompt(model, tokenizer) once.",
            UserWarning,
            stacklevel=4,
        )
        prefix = torch.zeros(0, dtype=torch.long)
        decoder._restkv_reconstruction_prefix = prefix
    return prefix


def _decoder(model):
    """The decoder model (``model.model`` of a ``*ForCausalLM``) whose forward runs the prefill."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model
