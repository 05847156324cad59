"""The transformers versions restkv's attention patch is written against.

The patched forward follows transformers 5's attention modules (``cache`` argument,
positions derived from ``cache.get_seq_length()``, layer-wise ``Cache``). Other versions
have changed exactly these names before, and a mismatch used to make peer libraries stop
compressing without an error, so the version is checked when patching: older than the
oldest supported release is refused; newer than the newest one tested runs, with a one-line
warning (``scripts/check_transformers.sh VERSION`` runs the exactness tests on any release).
"""

from __future__ import annotations

import os
import warnings

import transformers
from packaging.version import Version

#: the oldest release restkv runs on
MIN_TRANSFORMERS = Version("5.22.0")
#: the newest release the exactness tests passed on (``scripts/check_transformers.sh``)
NEWEST_TESTED = Version("5.25.0")
#: ``RESTKV_TRANSFORMERS_CHECK=warn`` turns the refusal of an older release into a warning, so that
#: ``scripts/check_transformers.sh`` can find out whether one works
CHECK_VARIABLE = "RESTKV_TRANSFORMERS_CHECK"


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
    """The installed transformers is older than restkv supports."""


class UntestedTransformersVersion(UserWarning):
    """The installed transformers is newer than the newest release restkv was tested on."""


def check_transformers_version(version: str | None = None) -> None:
    """Raise if ``version`` (default: the installed one) is older than the oldest supported
    release; warn once, in one line, if it is newer than the newest tested one."""
    found = Version(version or transformers.__version__)
    if found < MIN_TRANSFORMERS:
        message = (f"restkv supports transformers >={MIN_TRANSFORMERS} (tested up to {NEWEST_TESTED}); found {found}. "
                   f"Install a supported version: pip install 'transformers>={MIN_TRANSFORMERS}'")
        if os.environ.get(CHECK_VARIABLE) != "warn":
            raise UnsupportedTransformersVersion(message)
        warnings.warn(message, UntestedTransformersVersion, stacklevel=2)
    elif found.release[:3] > NEWEST_TESTED.release[:3]:
        warnings.warn(f"restkv was tested with transformers {MIN_TRANSFORMERS} to {NEWEST_TESTED}; found {found}, "
                      f"untested (bash scripts/check_transformers.sh {found} runs the exactness tests on it)",
                      UntestedTransformersVersion, stacklevel=2)
