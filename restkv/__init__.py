"""restkv: KV cache compression for Hugging Face transformers models.

Importing the package imports every folder of parts (``policies``, ``allocations``, ``switches``,
``merges``, ``quantizers``); each part registers itself from its own file, so configs can name
it, and a new part is one new file.
"""

from restkv import allocations, merges, policies, quantizers, switches  # noqa: F401  (their parts register)
from restkv.config import CompressionConfig, ConfigError
from restkv.pipeline.compress import CompressedKV, compress_kv
from restkv.policies import available_methods

__version__ = "0.1.0"


def compression(model, config=None, /, **options):
    """``with restkv.compression(model, method=..., ...):`` or with the parts as values (``policy=``, ``switches=``...):
    ``restkv.integrations.transformers.patching.compression``."""
    from restkv.integrations.transformers.patching import compression as context

    return context(model, config, **options)


__all__ = ["CompressedKV", "CompressionConfig", "ConfigError", "available_methods", "compress_kv", "compression"]
