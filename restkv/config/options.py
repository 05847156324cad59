"""Typed, self-validating option dataclasses and the registry of compression parts.

Every part of a compression run (a scorer, an allocation, a merge, the residual cache)
declares its own options as fields of a frozen dataclass derived from ``Options``, each
with ``option(default, help, ...)``. The field name is the public flag name
(``--<name>``), the help text is the flag's help, and the declared type, choices and range
are checked when the part is built, so a bad value fails with the flag's name before
anything runs. ``restkv.config`` composes the parts of one run; the runners build their
command-line flags from the same declarations.

Parts register under a kind (``method``, ``allocation``, ``merge``, ``switch``,
``quantization``) with ``register``; the policies, allocations, merges, switches and
quantisers do so when their modules are imported (``import restkv`` imports them all).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import pkgutil
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

#: kinds of registered parts; a ``switch`` is turned on by a boolean flag named after it (``--residual``);
#: a ``quantization`` is chosen by ``--quant_method``
KINDS = ("method", "allocation", "merge", "switch", "quantization")
#: the flag that chooses a part of each kind by name (a switch is its own flag, ``--<name>``)
KIND_FLAGS = {"method": "method", "allocation": "allocation", "merge": "merge", "quantization": "quant_method"}


def activation_flag(cls: type) -> str:
    """The flag that makes a registered part active (``--method restkv``, ``--residual``)."""
    for kind, flag in KIND_FLAGS.items():
        if cls in registered(kind):
            return f"--{flag} {cls.name}"
    return f"--{cls.name}"


class ConfigError(ValueError):
    """A compression setting is invalid; the message names the flag and the allowed values."""


def option(
    default: Any,
    help: str,
    choices: tuple[str, ...] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    names_file: bool = False,
) -> Any:
    """A dataclass field that is also a command-line flag.

    ``choices`` (strings), ``minimum``/``maximum`` (numbers, inclusive unless
    ``exclusive_minimum``) are checked with the field's type when the part is built.
    ``names_file``: the value is the path of a file the run reads (weights, scores), so a run's
    records fingerprint its content, not only its name.
    """
    metadata = {"help": help, "choices": choices, "minimum": minimum, "maximum": maximum,
                "exclusive_minimum": exclusive_minimum, "names_file": names_file}
    if isinstance(default, (list, dict, set)):
        raise TypeError("option defaults must be immutable (use a tuple)")
    return field(default=default, metadata=metadata)


def redeclared(owner: type, name: str, default: Any) -> Any:
    """Option ``name`` of ``owner`` (a base part) with another default, for a part whose paper sets
    one: the flag stays declared once, its help, type, choices and range the owner's."""
    return field(default=default, metadata=owner.__dataclass_fields__[name].metadata)


@dataclass(frozen=True)
class Options:
    """Base of every part's options: fields are checked against their declared types."""

    def __post_init__(self) -> None:
        for spec in option_specs(type(self)).values():
            object.__setattr__(self, spec.name, spec.check(getattr(self, spec.name)))
        self.validate()

    def validate(self) -> None:
        """Checks that involve several fields of the part (override; raise ``ConfigError``)."""

    def check(self, config) -> None:
        """Checks against the rest of the composed ``config`` (budget, window, other parts)."""

    def check_model(self, config, model) -> None:
        """Checks against the model the config is given to (a ``restkv.config.ModelShape``: layers,
        heads, head dim, sliding windows, dtype), made when the model is configured, before it runs."""

    def pre_rope_flags(self) -> list[str]:
        """The flags of this part that read keys or queries before RoPE (``restkv.scoring.rope``), for the
        message that refuses them on a layer whose rotation restkv cannot undo (override)."""
        return []

    def options(self) -> dict[str, Any]:
        """The part's options by flag name."""
        return {name: getattr(self, name) for name in option_specs(type(self))}

    def file_read(self, name: str) -> str | None:
        """The file the option ``name`` (declared ``names_file``) makes the run read: its value, or
        the file a part reads by default (override)."""
        return getattr(self, name)


@dataclass(frozen=True)
class OptionSpec:
    """One declared option: its flag name, type, default, help and bounds."""

    name: str
    kind: type  # bool, int, float, str or tuple (of ``item``)
    item: type | None
    optional: bool
    default: Any
    help: str
    choices: tuple[str, ...] | None
    minimum: float | None
    maximum: float | None
    exclusive_minimum: bool
    names_file: bool = False

    def check(self, value: Any) -> Any:
        """``value`` in its canonical form (lists become tuples), or ``ConfigError`` naming the flag."""
        if value is None:
            if self.optional:
                return None
            raise ConfigError(f"--{self.name} needs a value")
        if self.kind is tuple:
            if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
                raise ConfigError(f"--{self.name} must be a list of {self.item.__name__} values; got {value!r}")
            return tuple(self._scalar(item, self.item) for item in value)
        return self._scalar(value, self.kind)

    def _scalar(self, value: Any, kind: type) -> Any:
        flag = f"--{self.name}"
        if kind is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"{flag} must be a boolean ({flag} / --no-{self.name}); got {value!r}")
            return value
        if kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{flag} must be an integer{self._bound(' ')}; got {value!r}")
        elif kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"{flag} must be a finite number{self._bound(' ')}; got {value!r}")
            value = float(value)
        elif kind is str:
            if not isinstance(value, str):
                raise ConfigError(f"{flag} must be a string; got {value!r}")
            if self.choices is not None and value not in self.choices:
                raise ConfigError(f"{flag} {value!r} is not allowed; choose one of {', '.join(self.choices)}")
            return value
        self._check_range(value, flag)
        return value

    def _check_range(self, value: float, flag: str) -> None:
        low_fails = self.minimum is not None and (
            value <= self.minimum if self.exclusive_minimum else value < self.minimum
        )
        high_fails = self.maximum is not None and value > self.maximum
        if low_fails or high_fails:
            bound = self._bound("")
            raise ConfigError(f"{flag} must {'lie' if bound.startswith('in') else 'be'} {bound}; got {value}")

    def _bound(self, lead: str) -> str:
        """``in [0, 1]``, ``> 0`` or ``>= 1`` after ``lead`` ("" without bounds)."""
        low, high = self.minimum, self.maximum
        if low is not None and high is not None and not self.exclusive_minimum:
            return f"{lead}in [{low:g}, {high:g}]"
        parts = [f"{'>' if self.exclusive_minimum else '>='} {low:g}"] if low is not None else []
        parts += [f"<= {high:g}"] if high is not None else []
        return lead + " and ".join(parts) if parts else ""


_SPECS: dict[type, dict[str, OptionSpec]] = {}


def option_specs(cls: type) -> dict[str, OptionSpec]:
    """The declared options of an ``Options`` class, by flag name (cached per class)."""
    if cls not in _SPECS:
        hints = typing.get_type_hints(cls)
        specs = {}
        for declared in dataclasses.fields(cls):
            if "help" not in declared.metadata:
                continue
            kind, item, optional = _parse_annotation(cls, declared.name, hints[declared.name])
            meta = declared.metadata
            specs[declared.name] = OptionSpec(declared.name, kind, item, optional, declared.default, meta["help"],
                                              meta["choices"], meta["minimum"], meta["maximum"],
                                              meta["exclusive_minimum"], meta["names_file"])
        _SPECS[cls] = specs
    return _SPECS[cls]


def _parse_annotation(cls: type, name: str, annotation: Any) -> tuple[type, type | None, bool]:
    optional = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(members) < len(typing.get_args(annotation))
        if len(members) != 1:
            raise TypeError(f"{cls.__name__}.{name}: an option has one type (optionally | None)")
        annotation = members[0]
    if typing.get_origin(annotation) is tuple:
        return tuple, typing.get_args(annotation)[0], optional
    if annotation in (bool, int, float, str):
        return annotation, None, optional
    raise TypeError(f"{cls.__name__}.{name}: options are bool, int, float, str or tuple[...]; got {annotation}")


# ---------------------------------------------------------------- the registry
_REGISTRY: dict[str, dict[str, type]] = {kind: {} for kind in KINDS}
_VERSION = [0]


def registry_version() -> int:
    """Changes whenever a part is registered or removed (lets derived tables be cached)."""
    return _VERSION[0]


def register(kind: str) -> Callable[[type], type]:
    """Class decorator: make an ``Options`` part available as ``--<kind> <cls.name>``.

    ``@register("method")`` makes a policy a ``--method``; ``@register("allocation")`` an
    ``--allocation``; ``@register("merge")`` a ``--merge``. Names are unique per kind.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown part kind {kind!r}; one of {', '.join(KINDS)}")

    def add(cls: type) -> type:
        name = cls.__dict__.get("name")
        if not isinstance(name, str) or not name:
            raise TypeError(f"{cls.__name__} needs a class attribute `name` to be registered as a {kind}")
        if name in _REGISTRY[kind]:
            raise ValueError(f"{kind} {name!r} is registered twice")
        option_specs(cls)  # a malformed declaration fails at import, not at the first run
        _REGISTRY[kind][name] = cls
        _VERSION[0] += 1
        return cls

    return add


def unregister(kind: str, name: str) -> None:
    """Remove a registered part (tests and notebooks that register a temporary method)."""
    _REGISTRY[kind].pop(name, None)
    _VERSION[0] += 1


def lookup(kind: str, name: str, flag: str | None = None) -> type:
    """The part registered as ``name``; the error names the flag (``--<kind>`` unless ``flag``
    is given) and lists the known names."""
    try:
        return _REGISTRY[kind][name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"--{flag or kind} {name!r} is not a known {kind}; choose one of {', '.join(names(kind))}"
        ) from None


def names(kind: str) -> list[str]:
    """Registered names of a kind, sorted."""
    return sorted(_REGISTRY[kind])


def registered(kind: str) -> list[type]:
    """Registered classes of a kind, by name."""
    return [_REGISTRY[kind][name] for name in names(kind)]


def import_folder(package: str, path, kind: str) -> Callable[[str], type]:
    """Import every module of a folder of parts (``restkv/policies``, ``restkv/allocations``...), so each
    part registers itself from its own file: a new part is one new file, named in no list. Returns the
    folder's module ``__getattr__``: its registered ``kind`` parts by class name (``from restkv.switches
    import ResidualCache``), to give as values (``restkv.config.parts``)."""
    for module in pkgutil.iter_modules(path):
        importlib.import_module(f"{package}.{module.name}")

    def part_class(name: str) -> type:
        found = next((cls for cls in registered(kind) if cls.__name__ == name), None)
        if found is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r} (its {kind} parts: "
                                 f"{', '.join(cls.__name__ for cls in registered(kind))})")
        return found

    return part_class

