"""The original release's entry point: ``from restkv.monkeypatch import replace_llama``.

Patching lives in ``restkv.integrations.transformers.patching``; this module is its public path.
"""

from restkv.integrations.transformers.patching import (compression, config_of, configure, family_of, is_patched,
                                                       replace_family, replace_for_model, replace_gemma, replace_llama,
                                                       replace_mistral, replace_qwen2, shape_of, unpatch)

__all__ = ["compression", "config_of", "configure", "family_of", "is_patched", "replace_family", "replace_for_model",
           "replace_gemma", "replace_llama", "replace_mistral", "replace_qwen2", "shape_of", "unpatch"]
