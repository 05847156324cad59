"""restkv: KV cache compression for Hugging Face transformers models."""

from restkv.compress import CompressedKV, compress_kv
from restkv.config import CompressionConfig, ConfigError
from restkv.policies import available_methods

__version__ = "0.1.0"

__all__ = ["CompressedKV", "CompressionConfig", "ConfigError", "available_methods", "compress_kv"]
