"""``--config FILE`` and ``--plugin``: a command's flags written down in a file, and the plugins
loaded before its parser is built.

A config file is a JSON (``.json``) or YAML (``.yaml``/``.yml``, with PyYAML) mapping of the
command's flags by name (any of a flag's long names without ``--``) to values: a number or
string, a list for a flag taking several values, true/false for a switch; null leaves a flag
unset. Flags given on the command line override the file's (a flag of a mutually exclusive pair
given on the command line drops the file's other one). A results folder's ``run_meta.json`` is
a config of the runner that wrote it: its ``flags`` section is read and the rest, the run's
provenance (settings, datasets, versions, git state...), is what the run recorded, not flags, so
it is passed over. An unknown key, a run_meta.json of another benchmark, a file that is missing
or does not parse: one error naming the key or file (exit status 2), before anything runs.

Plugins (``restkv.config.plugins``) come from ``--plugin`` (the file's ``plugin`` list first,
then the command line's) and from installed packages' ``restkv.parts`` entry points; they are
loaded before the parser is built, so the parts they register are flags and choices like any
other.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from restkv.benchmarks.errors import FlagError
from restkv.config.plugins import PluginError, load_plugins

#: the section of a ``run_meta.json`` that holds the flags of the run
FLAGS_SECTION = "flags"


def add_config_flags(parser: argparse.ArgumentParser, reruns_folders: bool = False) -> None:
    """``--config FILE`` and ``--plugin PATH_OR_MODULE`` (repeatable); ``reruns_folders``: the
    command is a runner, which takes its results folders' ``run_meta.json``."""
    group = parser.add_argument_group("configuration")
    group.add_argument("--config", metavar="FILE", default=None,
                       help="read flags from a YAML or JSON file (flags given here override it)" + (
                           "; a results folder's run_meta.json re-runs that folder's settings" if reruns_folders
                           else ""))
    group.add_argument("--plugin", metavar="PATH_OR_MODULE", action="append", default=None,
                       help="import a .py file or a module that registers parts (a new --method, allocation, merge, "
                            "switch or quantization); repeatable. Installed packages' restkv.parts entry points are "
                            "loaded too")


def parse_command_line(build: Callable[[], argparse.ArgumentParser], argv: Sequence[str] | None = None,
                       run_meta_of: str | None = None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    """Parse ``argv`` (default: ``sys.argv[1:]``) with ``--config``'s flags under it: read the file,
    load the plugins, then ``build()`` the parser. ``run_meta_of``: the benchmark whose results
    folders' ``run_meta.json`` this command takes (None: the command takes none). Returns the flags
    and the parser (for the caller's own errors)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    early.add_argument("--config", default=None)
    early.add_argument("--plugin", action="append", default=[])
    try:
        known, _ = early.parse_known_args(argv)
    except argparse.ArgumentError as error:
        build().error(str(error))
    try:
        values = read_config(known.config, run_meta_of) if known.config is not None else {}
        plugins = [*(str(item) for item in _listed(values.get("plugin"))), *known.plugin]
        load_plugins(plugins)
    except (FlagError, PluginError) as error:
        build().error(str(error))
    parser = build()
    from_file = config_tokens(parser, values, known.config, argv) if values else []
    if from_file:
        _check_alone(parser, from_file, known.config)
    args = parser.parse_args([*from_file, *argv])
    if args.config != known.config or (getattr(args, "plugin", None) or []) != plugins:
        parser.error("write --config and --plugin in full: they are read before the other flags")
    return args, parser


def read_config(path: str, run_meta_of: str | None = None) -> dict[str, Any]:
    """The flags a config file holds, by name (``FlagError`` naming the file otherwise)."""
    file = Path(path)
    if not file.is_file():
        raise FlagError(f"--config {path}: no such file")
    text = file.read_text(encoding="utf-8")
    suffix = file.suffix.lower()
    if suffix == ".json":
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise FlagError(f"--config {path}: not valid JSON ({error})") from None
    elif suffix in (".yaml", ".yml"):
        values = _read_yaml(text, path)
    else:
        raise FlagError(f"--config {path}: give a .json, .yaml or .yml file")
    if not isinstance(values, dict):
        raise FlagError(f"--config {path}: holds a {type(values).__name__}; a config file is a mapping of flag "
                        "names to values")
    return _run_meta_flags(values, path, run_meta_of) if _is_run_meta(values) else values


def config_tokens(parser: argparse.ArgumentParser, values: dict[str, Any], path: str,
                  argv: Sequence[str] = ()) -> list[str]:
    """``values`` as command-line tokens of ``parser`` (``FlagError``-style parser errors name the
    key and file); keys that a mutually exclusive flag given in ``argv`` overrides are left out."""
    actions = _actions_by_name(parser)
    unknown = [key for key in values if key not in actions]
    if unknown:
        near = {key: difflib.get_close_matches(key, actions, n=1, cutoff=0.8) for key in unknown}
        hints = "; ".join(f"{key} (did you mean {near[key][0]}?)" if near[key] else key for key in unknown)
        parser.error(f"--config {path}: unknown key(s) {hints}: not flags of {parser.prog} (is it the config of "
                     "another command?)")
    overridden = _overridden(parser, argv)
    tokens: list[str] = []
    for key, value in values.items():
        action = actions[key]
        if value is None or action in overridden:
            continue
        try:
            tokens += _tokens(action, value)
        except FlagError as error:
            parser.error(f"--config {path}: {key}: {error}")
    return tokens


def _tokens(action: argparse.Action, value: Any) -> list[str]:
    """One flag's tokens for a value of the file."""
    flag = next(option for option in action.option_strings if option.startswith("--"))
    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise FlagError(f"takes true or false; got {value!r}")
        return [flag if value else f"--no-{flag[2:]}"]
    if action.nargs == 0:  # store_true / store_false
        if not isinstance(value, bool):
            raise FlagError(f"takes true or false; got {value!r}")
        return [flag] if value == (action.const is True) else []
    if isinstance(value, dict):
        raise FlagError(f"takes {'values' if action.nargs in ('+', '*') else 'a value'}; got a mapping")
    if isinstance(action, argparse._AppendAction):
        return [token for item in _listed(value) for token in (flag, str(item))]
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        return [flag, *(str(item) for item in _listed(value))]
    if isinstance(value, list):
        raise FlagError(f"takes one value; got a list {value!r}")
    return [f"{flag}={value}"]


def _actions_by_name(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every flag a config file may set, by each of its long names without ``--`` (not ``--config``
    itself, nor ``--help``)."""
    names: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if action.dest in ("config", "help", "help_all") or isinstance(action, argparse._HelpAction):
            continue
        for option in action.option_strings:
            if option.startswith("--") and not option.startswith("--no-"):
                names.setdefault(option[2:], action)
    return names


def _overridden(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[argparse.Action]:
    """The actions a mutually exclusive flag given on the command line excludes."""
    given = {token.split("=", 1)[0] for token in argv if token.startswith("--")}
    excluded: set[argparse.Action] = set()
    for group in parser._mutually_exclusive_groups:
        chosen = [action for action in group._group_actions if given & set(action.option_strings)]
        if chosen:
            excluded.update(action for action in group._group_actions if action not in chosen)
    return excluded


def _check_alone(parser: argparse.ArgumentParser, tokens: list[str], path: str) -> None:
    """Parse the file's flags alone, so a bad value in it is reported as the file's."""

    def refuse(message: str):
        raise FlagError(message)

    parser.error = refuse  # type: ignore[method-assign]
    try:
        parser.parse_args(tokens)
        message = None
    except FlagError as error:
        message = str(error)
    finally:
        del parser.error
    if message is not None:
        parser.error(f"--config {path}: {message}")


def _listed(value: Any) -> list:
    """A list value (a single value stands for a list of one)."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _read_yaml(text: str, path: str) -> Any:
    try:
        import yaml
    except ImportError:
        raise FlagError(f"--config {path}: reading YAML needs PyYAML (pip install pyyaml), or give a .json file") \
            from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise FlagError(f"--config {path}: not valid YAML ({' '.join(str(error).split())})") from None


def _is_run_meta(values: dict[str, Any]) -> bool:
    """Whether a mapping is a results folder's ``run_meta.json`` (``restkv.benchmarks.run_folder``)."""
    return isinstance(values.get("settings"), dict) and "args" in values


def _run_meta_flags(meta: dict[str, Any], path: str, run_meta_of: str | None) -> dict[str, Any]:
    """The flags a ``run_meta.json`` recorded, after checking it is one of this command's benchmark."""
    benchmark = meta["settings"].get("benchmark")
    if run_meta_of is None:
        raise FlagError(f"--config {path} is a results folder's run_meta.json (a {benchmark} run); give it to the "
                        "runner that wrote it")
    if benchmark != run_meta_of:
        raise FlagError(f"--config {path} is the run_meta.json of a {benchmark} run; this command runs {run_meta_of}")
    if not isinstance(meta.get(FLAGS_SECTION), dict):
        raise FlagError(f"--config {path}: this run_meta.json has no '{FLAGS_SECTION}' section (written by an older "
                        "restkv); give its flags on the command line (its 'args' section lists them)")
    return meta[FLAGS_SECTION]
