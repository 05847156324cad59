"""restkv: KV cache compression for Hugging Face transformers models.

Importing the package registers every part of a compression run (the methods in
``restkv.policies``, the allocations, the merges, the residual cache, key-channel pruning, the
score switches of CriticalKV, ChunkKV, threshold eviction, independent chunks and block-wise
scoring, key re-rotation, and the quantisers), so configs can name them.
"""

from restkv import (  # noqa: F401  (they register their parts)
    allocation, block_scoring, channel_pruning, chunkkv, critical, independent_chunks, key_rerotation, merging,
    policies, quantization, residual, threshold,
)
from restkv.compress import CompressedKV, compress_kv
from restkv.config import CompressionConfig, ConfigError
from restkv.policies import available_methods

__version__ = "0.1.0"


def compression(model, config=None, /, **options):
    """``with restkv.compression(model, method=..., ...):`` (``restkv.monkeypatch.compression``)."""
    from restkv.monkeypatch import compression as context

    return context(model, config, **options)


__all__ = ["CompressedKV", "CompressionConfig", "ConfigError", "available_methods", "compress_kv", "compression"]
