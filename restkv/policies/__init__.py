"""The methods: one module per ``--method``, each registering its policy.

Every module of this package is imported here, so a new method is one new file: its
``@register("method")`` class becomes a ``--method``, a ``replace_*`` keyword, a set of
runner flags (its options) and an entry of every per-method test matrix. What each method computes,
its defaults and its paper: ``docs/methods/`` (one page per family, indexed in ``docs/methods/README.md``).
"""

from __future__ import annotations

from restkv.config.options import import_folder, lookup, names
from restkv.policies.base import GroupedScores, Policy, PooledScores

#: ``from restkv.policies import SnapKV``: a method's policy to give as a value
__getattr__ = import_folder(__name__, __path__, "method")


def get_policy(name: str) -> type[Policy]:
    """The policy class registered as ``--method name``; the error lists the known methods."""
    return lookup("method", name)


def available_methods() -> list[str]:
    """Every registered ``--method`` name, sorted."""
    return names("method")


__all__ = ["GroupedScores", "Policy", "PooledScores", "available_methods", "get_policy"]
