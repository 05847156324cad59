"""The transformers versions restkv's attention patch is written against.

The patched forward follows transformers 5's attention modules (``cache`` argument,
positions derived from ``cache.get_seq_length()``, layer-wise ``Cache``). Other versions
have changed exactly these names before, and a mismatch used to make peer libraries stop
compressing without an error, so the range is checked when patching.
"""

from __future__ import annotations

import transformers
from packaging.version import Version

MIN_TRANSFORMERS = Version("5.22.0")
MAX_TRANSFORMERS_EXCLUSIVE = Version("5.25.0")


#: transformers 5.24 renamed the model/attention argument ``past_key_values`` to ``cache``
#: (the old name stays a deprecated alias until 5.40).
CACHE_ARGUMENT = "cache" if Version(transformers.__version__) >= Version("5.24.0") else "past_key_values"


def with_cache(cache, **kwargs) -> dict:
    """Keyword arguments for ``model(...)``/``model.generate(...)`` passing ``cache``."""
    return {CACHE_ARGUMENT: cache, **kwargs}


def output_cache(output):
    """The cache held by a model or ``generate`` output, under either name."""
    return getattr(output, "cache", None) if CACHE_ARGUMENT == "cache" else output.past_key_values


class UnsupportedTransformersVersion(RuntimeError):
    """The installed transformers is outside the tested range."""


def check_transformers_version(version: str | None = None) -> None:
    """Raise if ``version`` (default: the installed one) is outside the supported range."""
    found = Version(version or transformers.__version__)
    if not MIN_TRANSFORMERS <= found < MAX_TRANSFORMERS_EXCLUSIVE:
        raise UnsupportedTransformersVersion(
            f"restkv supports transformers >={MIN_TRANSFORMERS},<{MAX_TRANSFORMERS_EXCLUSIVE}; found {found}. "
            f"Install a supported version: pip install 'transformers>={MIN_TRANSFORMERS},<{MAX_TRANSFORMERS_EXCLUSIVE}'"
        )
