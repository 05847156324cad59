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
