"""``restkv.describe(method)``: one method's options, source and what it composes with, from its declarations.

Everything shown is read from the registry and the parts' own declarations, so a new part (or a plugin's) is
described as soon as it registers: its options (``option(default, help, ...)``), its ``reference`` (the paper
or source a part names as a class attribute), what a method is defined with (its own allocation, merge or
switches), and which allocations, merges, switches and quantisers it composes with, found by composing each
with it as ``CompressionConfig`` would: a refusal is shown with the reason ``CompressionConfig`` gives.

::

    >>> import restkv
    >>> restkv.describe("snapkv")          # prints as text in a REPL or a notebook
    --method snapkv (SnapKV) ...
    >>> restkv.describe("snapkv").options["kernel_size"].default
    5
"""

from __future__ import annotations

import inspect
import re
import warnings
from dataclasses import dataclass, field, replace

from restkv.config.composition import CompressionConfig, RunOptions
from restkv.config.options import KIND_FLAGS, KINDS, ConfigError, OptionSpec, lookup, option_specs, registered

#: the budget a method is composed at to see what it composes with (any budget above the window would do)
TRIAL_BUDGET = 1024
#: the method a part is also composed with, to tell a part that needs a value of its own from one the
#: described method refuses
NEUTRAL_METHOD = "snapkv"


@dataclass(frozen=True)
class PartDescription:
    """What ``describe`` says of one registered part (see the module docstring); ``str()`` is the text."""

    kind: str
    name: str
    class_name: str
    summary: str
    reference: str | None
    options: dict[str, OptionSpec]
    #: a method's own allocation, merge and switches, as flags (``--allocation pyramid``)
    defined_with: tuple[str, ...] = ()
    #: kind -> the parts of that kind the method composes with
    composes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: kind -> {part: why CompressionConfig refuses it with this method}
    refused: dict[str, dict[str, str]] = field(default_factory=dict)
    #: part -> what it needs given before it runs at all (a file, a threshold), with any method
    needs: dict[str, str] = field(default_factory=dict)
    #: what the method itself needs given before it composes (a file of weights), or None
    needs_first: str | None = None

    def __str__(self) -> str:
        flag = f"--{KIND_FLAGS[self.kind]} {self.name}" if self.kind in KIND_FLAGS else f"--{self.name}"
        lines = [f"{flag} ({self.class_name})", self.summary,
                 f"Source: {self.reference or 'no reference given (the part declares no `reference`)'}"]
        if self.defined_with:
            lines.append(f"Defined with: {', '.join(self.defined_with)}")
        lines.append("Options:" if self.options else "Options: none of its own")
        lines += [_option_line(spec) for spec in self.options.values()]
        if self.kind == "method":
            lines += _composition_lines(self)
        return "\n".join(lines)

    __repr__ = __str__  # a REPL or a notebook shows the text


def describe(name: str, kind: str = "method") -> PartDescription:
    """Describe the registered part ``name`` of ``kind`` (a ``--method`` by default; or ``"allocation"``,
    ``"merge"``, ``"switch"``, ``"quantization"``): its options with their defaults and help, its source, and
    for a method what it is defined with and what it composes with. Example: ``print(restkv.describe("kvzip"))``,
    ``restkv.describe("residual", kind="switch").options``.

    An unknown name is a ``ConfigError`` listing the known ones."""
    if kind not in KINDS:
        raise ConfigError(f"describe: kind {kind!r} is not a kind of part; one of {', '.join(KINDS)}")
    cls = _part_class(kind, name)
    base = PartDescription(kind, name, cls.__name__, _summary(cls), vars(cls).get("reference"), option_specs(cls))
    if kind != "method":
        return base
    return _with_composition(base, cls)


def _part_class(kind: str, name: str) -> type:
    if kind == "switch":
        found = next((cls for cls in registered("switch") if cls.name == name), None)
        if found is None:
            known = ", ".join(cls.name for cls in registered("switch"))
            raise ConfigError(f"--{name} is not a known switch; choose one of {known}")
        return found
    return lookup(kind, name, KIND_FLAGS[kind])


def _summary(cls: type) -> str:
    """The first paragraph of the part's module docstring (each part's file opens by saying what it is)."""
    text = inspect.getdoc(inspect.getmodule(cls)) or inspect.getdoc(cls) or ""
    return " ".join(text.split("\n\n")[0].split())


def _with_composition(base: PartDescription, cls: type) -> PartDescription:
    policy = cls()
    own = [f"--allocation {policy.own_allocation()}"] if policy.own_allocation() else []
    own += [f"--merge {cls.own_merge}"] if cls.own_merge else []
    own += [f"--{name}" for name in cls.own_switches]
    if cls.base_method:
        own.insert(0, f"--method {cls.base_method}'s scores")
    try:
        _composed(name=base.name)
    except ConfigError as refusal:
        return replace(base, defined_with=tuple(own), needs_first=str(refusal))
    composes: dict[str, list[str]] = {}
    refused: dict[str, dict[str, str]] = {}
    needs: dict[str, str] = {}
    for kind in ("allocation", "merge", "switch", "quantization"):
        for part in registered(kind):
            option = {part.name: True} if kind == "switch" else {KIND_FLAGS[kind]: part.name}
            reason = _refusal(base.name, option)
            if reason is None:
                composes.setdefault(kind, []).append(part.name)
            elif reason == _refusal(NEUTRAL_METHOD, option):
                needs[part.name] = reason
            else:
                refused.setdefault(kind, {})[part.name] = reason
    return replace(base, defined_with=tuple(own), composes={kind: tuple(names) for kind, names in composes.items()},
                   refused=refused, needs=needs)


def _composed(name: str, **options) -> CompressionConfig:
    with warnings.catch_warnings():  # an option the composition ignores is not news here
        warnings.simplefilter("ignore")
        return CompressionConfig(method=name, max_capacity_prompts=TRIAL_BUDGET, **options)


def _refusal(method: str, options: dict) -> str | None:
    """Why ``CompressionConfig`` refuses ``method`` with ``options``, or None."""
    try:
        _composed(method, **options)
    except ConfigError as refusal:
        return str(refusal)
    return None


def _option_line(spec: OptionSpec) -> str:
    """``  --kernel_size 5: help [>= 1]``: the flag, its default, its help and what it accepts."""
    default = "(none)" if spec.default is None else repr(spec.default) if isinstance(spec.default, str) \
        else str(spec.default)
    bounds = [f"{'>' if spec.exclusive_minimum else '>='} {spec.minimum:g}"] if spec.minimum is not None else []
    bounds += [f"<= {spec.maximum:g}"] if spec.maximum is not None else []
    accepts = " | ".join(spec.choices) if spec.choices else " and ".join(bounds)
    return f"  --{spec.name} {default}: {spec.help}" + (f" [{accepts}]" if accepts else "")


def _without(reason: str, name: str) -> str:
    """A refusal with the refused part's name left out, so the parts one rule refuses share a line."""
    return re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w-])", "<each>", reason)


def _composition_lines(part: PartDescription) -> list[str]:
    common = ", ".join(f"--{name}" for name in option_specs(RunOptions) if name != "method")
    lines = [f"Common options (every method; the budget is --max_capacity_prompts or --compression_ratio): {common}"]
    if part.needs_first is not None:
        return [*lines, f"Needs first: {part.needs_first}",
                "(what it composes with shows once that is given: restkv.CompressionConfig refuses what does not)"]
    lines.append("Composes with:")
    for kind, names in part.composes.items():
        flag = "switches" if kind == "switch" else f"--{KIND_FLAGS[kind]}"
        lines.append(f"  {flag}: {', '.join(names)}")
    if part.needs:
        lines.append(f"  and, once given a file or value of their own: {', '.join(part.needs)}")
    if part.refused:
        lines.append("Does not compose with:")
        for reasons in part.refused.values():
            by_reason: dict[str, list[str]] = {}
            for name, reason in reasons.items():
                by_reason.setdefault(_without(reason, name), []).append(name)
            lines += [f"  {', '.join(names)}: {reason}" for reason, names in by_reason.items()]
    budget = ", compression_ratio=0.8" if lookup("method", part.name).evicts else ""
    lines.append(f'Example: with restkv.compression(model, method="{part.name}"{budget}): model.generate(...)')
    return lines
