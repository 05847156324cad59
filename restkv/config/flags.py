"""The compression options as command-line flags, built from the parts' own declarations.

``add_compression_flags(parser)`` adds one ``--<name>`` per flat option of every registered
part (``restkv.config.option_names()``), with the declaring part's help, type and choices,
so a newly registered method's options are flags of every runner without other edits.
Flags default to None (not given), so each part's own defaults apply. With a scope
(``scoped_options``: the common options, the switches, and the options of one composition's
parts, a ``HelpScope``) the help lists only those; every flag is still parsed.
``config_from_flags(args)`` builds the ``CompressionConfig`` of the flags that were given.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Mapping

from restkv.config import CompressionConfig, ConfigError, RunOptions, flat_option_specs
from restkv.config.options import KIND_FLAGS, activation_flag, lookup, names, option_specs, registered


def _method_name(text: str) -> str:
    """The original release's scripts spell methods ``SnapKV``, ``FullKV``...; names are lower-case."""
    return text.lower()


@dataclass(frozen=True)
class HelpScope:
    """What a help scoped to one composition lists: its options, the parts they come from, and the
    composition in words (``scoped_options``)."""

    options: tuple[str, ...]
    parts: tuple[type, ...]
    words: str


def _argument(name: str, declarations: list, scope: HelpScope | None = None) -> tuple[dict[str, Any], str]:
    """argparse keywords and help text of one flat option (with ``scope``, the defaults of its parts only)."""
    if scope is not None:
        declarations = [(cls, s) for cls, s in declarations if cls in scope.parts] or declarations
    owner, spec = declarations[0]
    if spec.kind is bool:
        keywords: dict[str, Any] = {"action": argparse.BooleanOptionalAction}
    elif spec.kind is tuple:
        keywords = {"nargs": "*", "type": spec.item}
    else:
        keywords = {"type": _method_name if name == "method" else spec.kind}
    if spec.choices is not None:
        keywords["choices"] = spec.choices
    help_text = spec.help.replace("%", "%%")  # argparse formats help with %
    kind = next((kind for kind, flag in KIND_FLAGS.items() if flag == name), None)
    if kind is not None:
        unset = ["none"] if kind in ("merge", "quantization") else []
        help_text += f"; one of {', '.join([*unset, *names(kind)])}"
    defaults = {repr(s.default) for _, s in declarations}
    if owner is not RunOptions and len(declarations) == 1 and getattr(owner, "name", None):
        help_text += f" [{activation_flag(owner)}]"
    if len(defaults) == 1 and spec.default is not None:
        help_text += f" (default: {spec.default})"
    elif len(defaults) > 1:
        per_part = ", ".join(f"{getattr(cls, 'name', cls.__name__)}: {s.default}" for cls, s in declarations)
        help_text += f" (default per part: {per_part})"
    return keywords, help_text


def add_compression_flags(parser: argparse.ArgumentParser, scope: HelpScope | None = None) -> None:
    """One ``--<name>`` per flat compression option, help and choices from its declaration; with
    ``scope``, the help lists only its options, under a title that names its composition."""
    title = "compression (restkv.config.CompressionConfig)" + (f": {scope.words}" if scope else "")
    group = parser.add_argument_group(title)
    for name, declarations in flat_option_specs().items():
        keywords, help_text = _argument(name, declarations, scope)
        visible = scope is None or name in scope.options
        group.add_argument(f"--{name}", default=None, help=help_text if visible else argparse.SUPPRESS, **keywords)


def scoped_options(given: Mapping[str, Any]) -> HelpScope:
    """The options a help scoped to one composition lists, and the composition in words: the common
    options and switch flags, and the options of the parts ``given`` (flat option values, None for
    unset) names or its method is defined with (``--method`` default: ``RunOptions``')."""
    method = _method_name(given.get("method") or RunOptions.method)
    policy_cls = lookup("method", method)
    try:
        own_allocation = policy_cls().own_allocation()  # a method's options may choose it (--kvzip_layerwise)
    except ConfigError:
        own_allocation = getattr(policy_cls, "allocation", None)
    selected = [cls.name for cls in registered("allocation") if vars(cls).get("selected_by")
                and given.get(cls.selected_by)]
    allocation = given.get("allocation") or own_allocation or next(iter(selected), "uniform")
    merge = given.get("merge") or policy_cls.own_merge or "none"
    quantization = given.get("quant_method") or "none"
    switches = [cls.name for cls in registered("switch") if given.get(cls.name) or cls.name in policy_cls.own_switches]
    parts = [policy_cls, lookup("allocation", allocation)]
    parts += [lookup("merge", merge)] if merge != "none" else []
    parts += [lookup("quantization", quantization, "quant_method")] if quantization != "none" else []
    parts += [lookup("switch", name) for name in switches]
    shown = [*option_specs(RunOptions), *(cls.name for cls in registered("switch"))]
    shown += [name for cls in parts for name in option_specs(cls) if name not in shown]
    words = [f"--method {method}", f"{allocation} allocation", *([f"{merge} merge"] if merge != "none" else []),
             *([f"{quantization} quantization"] if quantization != "none" else []), *(f"--{s}" for s in switches)]
    return HelpScope(tuple(shown), (RunOptions, *registered("switch"), *parts), ", ".join(words))


def config_from_flags(args: argparse.Namespace) -> CompressionConfig:
    """The config of the flags that were given. A method that evicts nothing (``fullkv``) drops
    any budget flag (the release's scripts pass one for every method)."""
    options = {name: getattr(args, name) for name in flat_option_specs() if getattr(args, name, None) is not None}
    method = options.get("method", RunOptions.method)
    if method in names("method") and not lookup("method", method).evicts:
        options.pop("max_capacity_prompts", None)
        options.pop("compression_ratio", None)
    return CompressionConfig.from_options(**options)
