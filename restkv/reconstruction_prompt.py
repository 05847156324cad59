"""KVzip's reconstruction prompt for a model and its tokenizer (``set_reconstruction_prompt``): the public path
of ``restkv.integrations.transformers.reconstruction_prompt``."""

from restkv.integrations.transformers.reconstruction_prompt import set_reconstruction_prompt

__all__ = ["set_reconstruction_prompt"]
