"""Policy registry: ``--method`` name -> policy.

Each method lives in its own module and registers itself with ``@register_policy``.
"""

from __future__ import annotations

from restkv.policies.base import Policy, ScoringContext

_REGISTRY: dict[str, Policy] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make ``cls`` available as ``--method cls.name``."""
    if cls.name in _REGISTRY:
        raise ValueError(f"method {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls()
    return cls


def get_policy(name: str) -> Policy:
    """The policy registered as ``name``; the error lists the known methods."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(available_methods())}") from None


def available_methods() -> list[str]:
    return sorted(_REGISTRY)


# Registration happens on import; keep one line per method.
from restkv.policies import fullkv, h2o, l2norm, random_control, snapkv, streamingllm, tova  # noqa: E402,F401
from restkv.policies import restkv  # noqa: E402,F401
from restkv.policies import pyramidkv, adakv, headkv, cam  # noqa: E402,F401

__all__ = ["Policy", "ScoringContext", "available_methods", "get_policy", "register_policy"]
