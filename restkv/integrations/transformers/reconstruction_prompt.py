"""The reconstruction prompt: what the model reads before it repeats the context (KVzip).

``--observation reconstruction`` (``restkv.integrations.transformers.deferred``) scores a context by the attention of
the model repeating it. KVzip's reference (``model/wrapper.py`` ``self_task``, ``model/template.py``)
prefills the chat template's opening (system prompt, user header) and then the context, and
scores it in chunks of the context, each chunk read after: for the first, the instruction
``"\\n\\nRepeat the previous context exactly."``; for each later one, ``"\\n\\nRepeat the part of
the previous context exactly, starting with "`` and the previous chunk's last 8 tokens; in both
cases continuing the user turn that holds the context, then the template's closing tokens (the
end of the user turn and the assistant's header), then the chunk itself. So the repetition
opens no second turn: no second system prompt, no second BOS, no repeat of the opening. A
tokenizer without a chat template gets the reference's fallback closing, ``"\\n\\nAnswer: "``.

``--reconstruction_prompt`` (``restkv.config.composition.RECONSTRUCTION_PROMPTS``) chooses what
precedes each chunk: ``none`` (the default: the chunk right after the context), ``instruction`` (the
reference's, above), ``closing`` (the template's closing alone: the assistant repeats the context
unasked) or ``user_turn`` (the user turn closed and opened again as it began, the system prompt
included: the user repeats the question-free turn). ``set_reconstruction_prompt`` gives the model the
ids of those pieces (the runners call it once per model); ``reconstruction_prompt`` reads them and
``ReconstructionPrompt.before`` builds what precedes each chunk in the form asked. What is repeated is the
context alone: ``prefilled_ids[start:stop]`` for the span the prompt's builder knows
(``restkv.benchmarks.prompts.EncodedPrompt.context_span``: after the opening, before a
question).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from restkv.integrations.transformers.handles import model_state

#: the instruction that starts the reconstruction prompt (KVzip's)
RECONSTRUCTION_INSTRUCTION = "Repeat the previous context exactly."
#: what precedes every later chunk, then the previous chunk's last ``PREVIOUS_TAIL`` tokens (KVzip's)
CONTINUATION_INSTRUCTION = "Repeat the part of the previous context exactly, starting with "
#: kvpress's KVzipPress continuation (no trailing space; its parity fixtures replay it)
KVPRESS_CONTINUATION = CONTINUATION_INSTRUCTION.rstrip()
#: tokens of the previous chunk that a later chunk's instruction quotes (KVzip's ``prev_postfix_size``)
PREVIOUS_TAIL = 8
#: KVzip's closing for a model without a chat template
PLAIN_CLOSING = "\n\nAnswer: "
#: kvpress's KVzipPress closing for a model without a chat template (its parity fixtures replay it)
KVPRESS_CLOSING = "\n"
#: stands for a user message's content while a chat template is rendered
_CONTENT_MARK = "\ue000restkv-content\ue000"
#: what ``user_turn`` puts between the context and its repetition without a chat template (no turns to repeat)
PLAIN_TURN_BREAK = "\n\n"


def template_opening(tokenizer) -> str:
    """What the tokenizer's chat template puts before a user message's content (BOS, default system
    prompt, the user's header); empty without a template."""
    return _around_content(tokenizer)[0] if getattr(tokenizer, "chat_template", None) else ""


def template_closing(tokenizer) -> str:
    """What the tokenizer's chat template puts after a user message's content when the
    assistant answers next (the end of the turn and the assistant's header); ``PLAIN_CLOSING``
    without a template."""
    return _around_content(tokenizer)[1] if getattr(tokenizer, "chat_template", None) else PLAIN_CLOSING


def template_turn_repeat(tokenizer) -> str:
    """What closes the user turn holding the context and opens it again as the template began it (default
    system prompt and user header, without a second BOS); ``PLAIN_TURN_BREAK`` without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return PLAIN_TURN_BREAK
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": _CONTENT_MARK}], add_generation_prompt=False,
                                             tokenize=False)
    opening, turn_end = rendered.split(_CONTENT_MARK)
    bos = getattr(tokenizer, "bos_token", None)
    if bos and opening.startswith(bos) and _adds_bos(tokenizer):  # the sequence's marker, not the turn's syntax
        opening = opening[len(bos):]
    return turn_end + opening


def _adds_bos(tokenizer) -> bool:
    """Whether the tokenizer starts every sequence with its BOS token of its own accord."""
    ids = tokenizer("x", add_special_tokens=True).input_ids
    return bool(ids) and ids[0] == tokenizer.bos_token_id and ids != tokenizer("x", add_special_tokens=False).input_ids


def _around_content(tokenizer) -> tuple[str, str]:
    """The chat template's text before and after one user message's content (assistant next)."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": _CONTENT_MARK}], add_generation_prompt=True,
                                             tokenize=False)
    opening, closing = rendered.split(_CONTENT_MARK)
    return opening, closing


_NOTHING = torch.zeros(0, dtype=torch.long)


@dataclass(frozen=True)
class ReconstructionPrompt:
    """The token ids of the pieces around each repeated chunk (each tokenised apart, without
    special tokens, as KVzip's reference does)."""

    instruction: torch.Tensor  # "\n\n" + the first chunk's instruction
    continuation: torch.Tensor  # "\n\n" + a later chunk's instruction, before the quoted tail
    closing: torch.Tensor  # the end of the user turn and the assistant's header
    turn_repeat: torch.Tensor = _NOTHING  # the user turn closed and opened again (``template_turn_repeat``)

    def before(self, previous_chunk: torch.Tensor | None, form: str = "instruction") -> torch.Tensor:
        """The ids before a chunk in ``form`` (``RECONSTRUCTION_PROMPTS``): under ``instruction``, the first chunk's
        (``previous_chunk`` None) or a later one's, which quotes the previous chunk's last ``PREVIOUS_TAIL`` ids;
        the other forms put the same piece before every chunk."""
        if form == "instruction":
            if previous_chunk is None:
                return torch.cat([self.instruction, self.closing])
            return torch.cat([self.continuation, previous_chunk[-PREVIOUS_TAIL:].cpu(), self.closing])
        return {"none": _NOTHING, "closing": self.closing, "user_turn": self.turn_repeat}[form]


#: the prompt of a model without one set: the chunks are repeated with no instruction
NO_PROMPT = ReconstructionPrompt(_NOTHING, _NOTHING, _NOTHING, _NOTHING)


def set_reconstruction_prompt(model, tokenizer, instruction: str = RECONSTRUCTION_INSTRUCTION,
                              closing: str | None = None,
                              continuation: str = CONTINUATION_INSTRUCTION) -> ReconstructionPrompt:
    """Give ``model`` the pieces of the reconstruction prompt: ``"\\n\\n" + instruction`` before the
    first chunk, ``"\\n\\n" + continuation`` and the previous chunk's tail before a later one, each
    followed by ``closing`` (default ``template_closing``; ``KVPRESS_CLOSING`` with a continuation
    without its trailing space reproduces kvpress's KVzipPress); returns them. Without this call
    the repetition has no instruction (and says so once)."""
    def ids(text: str) -> torch.Tensor:
        return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.long)

    prompt = ReconstructionPrompt(ids(f"\n\n{instruction}"), ids(f"\n\n{continuation}"),
                                  ids(template_closing(tokenizer) if closing is None else closing),
                                  ids(template_turn_repeat(tokenizer)))
    model_state(_decoder(model)).reconstruction_prompt = prompt
    return prompt


def reconstruction_prompt(decoder) -> ReconstructionPrompt:
    """The decoder model's reconstruction prompt (``NO_PROMPT``, with a warning, if none was set)."""
    state = model_state(decoder)
    prompt = state.reconstruction_prompt
    if prompt is None:
        warnings.warn(
            "restkv: --observation reconstruction without a reconstruction prompt: the context is repeated with no "
            "instruction. Call restkv.integrations.transformers.reconstruction_prompt.set_reconstruction_prompt(model, "
            "tokenizer) once.",
            UserWarning,
            stacklevel=4,
        )
        prompt = state.reconstruction_prompt = NO_PROMPT
    return prompt


def _decoder(model):
    """The decoder model (``model.model`` of a ``*ForCausalLM``) whose forward runs the prefill."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model
