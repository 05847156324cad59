"""The reconstruction prompt: what the model is asked before it repeats the context (KVzip).

``--observation reconstruction`` (``restkv.deferred``) scores a context by the attention of the
model repeating it; the repetition starts with an instruction in the model's chat format. The
benchmark runners set it once per model (``set_reconstruction_prompt``); the deferred
compression reads it (``reconstruction_prefix``).
"""

from __future__ import annotations

import warnings

import torch

#: the instruction that starts the reconstruction prompt (KVzip's)
RECONSTRUCTION_INSTRUCTION = "Repeat the previous context exactly."


def set_reconstruction_prompt(model, tokenizer, instruction: str = RECONSTRUCTION_INSTRUCTION) -> torch.Tensor:
    """Give ``model`` its reconstruction prompt: ``instruction`` as a user turn of the tokenizer's
    chat template, ready for the assistant's repetition (a tokenizer without a template: the
    instruction on its own line). The benchmark runners call this; without it, the repetition
    starts with no instruction (and says so once)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": instruction}], add_generation_prompt=True,
                                             tokenize=False)
    else:
        text = f"\n\n{instruction}\n"
    ids = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.long)
    _decoder(model)._restkv_reconstruction_prefix = ids
    return ids


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

