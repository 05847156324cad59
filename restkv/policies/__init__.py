"""The methods: one module per ``--method``, each registering its policy.

Every module of this package is imported here, so a new method is one new file: its
``@register("method")`` class becomes a ``--method``, a ``replace_*`` keyword, a set of
runner flags (its options) and an entry of every per-method test matrix.
"""

from __future__ import annotations

import importlib
import pkgutil

from restkv.config.options import lookup, names
from restkv.policies.base import GroupedScores, Policy, PooledScores

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def get_policy(name: str) -> type[Policy]:
    """The policy class registered as ``--method name``; the error lists the known methods."""
    return lookup("method", name)


def available_methods() -> list[str]:
    """Every registered ``--method`` name, sorted."""
    return names("method")


__all__ = ["GroupedScores", "Policy", "PooledScores", "available_methods", "get_policy"]
