"""The original release's entry point: ``from restkv.monkeypatch import replace_llama``.

Patching lives in ``restkv.integrations.transformers.patching``; this module keeps the release's
import path for it.
"""

from restkv.integrations.transformers.patching import compression  # noqa: F401  (the release's public names)
from restkv.integrations.transformers.patching import (config_of, configure, family_of, replace_family,
                                                       replace_for_model, replace_gemma, replace_llama, replace_mistral,
                                                       replace_qwen2, unpatch)

__all__ = ["compression", "config_of", "configure", "family_of", "replace_family", "replace_for_model", "replace_gemma",
           "replace_llama", "replace_mistral", "replace_qwen2", "unpatch"]
