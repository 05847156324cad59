"""The compression options as command-line flags, built from the parts' own declarations.

``add_compression_flags(parser)`` adds one ``--<name>`` per flat option of every registered
part (``restkv.config.option_names()``), with the declaring part's help, type and choices,
so a newly registered method's options are flags of every runner without other edits.
Flags default to None (not given), so each part's own defaults apply.
``config_from_flags(args)`` builds the ``CompressionConfig`` of the flags that were given.
"""

from __future__ import annotations

import argparse
from typing import Any

from restkv.config import CompressionConfig, RunOptions, flat_option_specs
from restkv.config.options import activation_flag, lookup, names


def _method_name(text: str) -> str:
    """The original release's scripts spell methods ``SnapKV``, ``FullKV``...; names are lower-case."""
    return text.lower()


def _argument(name: str, declarations: list) -> tuple[dict[str, Any], str]:
    """argparse keywords and help text of one flat option."""
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
    if name == "method":
        help_text += f"; one of {', '.join(names('method'))}"
    defaults = {repr(s.default) for _, s in declarations}
    if owner is not RunOptions and len(declarations) == 1 and getattr(owner, "name", None):
        help_text += f" [{activation_flag(owner)}]"
    if len(defaults) == 1 and spec.default is not None:
        help_text += f" (default: {spec.default})"
    elif len(defaults) > 1:
        per_part = ", ".join(f"{getattr(cls, 'name', cls.__name__)}: {s.default}" for cls, s in declarations)
        help_text += f" (default per part: {per_part})"
    return keywords, help_text


def add_compression_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--<name>`` per flat compression option, help and choices from its declaration."""
    group = parser.add_argument_group("compression (restkv.config.CompressionConfig)")
    for name, declarations in flat_option_specs().items():
        keywords, help_text = _argument(name, declarations)
        group.add_argument(f"--{name}", default=None, help=help_text, **keywords)


def config_from_flags(args: argparse.Namespace) -> CompressionConfig:
    """The config of the flags that were given. A method that evicts nothing (``fullkv``) drops
    any budget flag (the release's scripts pass one for every method)."""
    options = {name: getattr(args, name) for name in flat_option_specs() if getattr(args, name, None) is not None}
    method = options.get("method", RunOptions.method)
    if method in names("method") and not lookup("method", method).evicts:
        options.pop("max_capacity_prompts", None)
        options.pop("compression_ratio", None)
    return CompressionConfig.from_options(**options)
