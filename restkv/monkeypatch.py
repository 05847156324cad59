"""The original release's entry point: patch a model family once, and every model of it compresses::

    from restkv.monkeypatch import replace_llama
    replace_llama(method="snapkv", max_capacity_prompts=128)      # before or after loading the model
    model.generate(input_ids, max_new_tokens=64)                  # compressed after the prefill

``replace_llama``, ``replace_mistral``, ``replace_qwen2``, ``replace_gemma`` (and ``replace_family`` for any
other decoder-only model type) take a method and its options (``restkv.describe(method)`` lists them);
``configure(model, ...)`` changes one model's options, ``unpatch()`` restores transformers' forwards. For one
model in a ``with`` block, ``restkv.compression(model, ...)``. Patching lives in
``restkv.integrations.transformers.patching``; this module is its public path.
"""

from restkv.integrations.transformers.patching import (compression, config_of, configure, family_of, is_patched,
                                                       replace_family, replace_for_model, replace_gemma, replace_llama,
                                                       replace_mistral, replace_qwen2, shape_of, unpatch)

__all__ = ["compression", "config_of", "configure", "family_of", "is_patched", "replace_family", "replace_for_model",
           "replace_gemma", "replace_llama", "replace_mistral", "replace_qwen2", "shape_of", "unpatch"]
