"""Parts from outside the package: plugin files, modules and installed packages.

A plugin is Python code that registers parts the normal way (``@register("method")`` on an
``Options`` dataclass, as every file of ``restkv/policies/`` does), so its method, allocation,
merge, switch or quantisation is a name and its options are flags like any other::

    from restkv.config.plugins import load_plugins
    load_plugins(["my_method.py", "my_package.scorers"])   # before building a config or a parser

``load_plugins`` imports each source (a ``.py`` file, or an importable module name) and then
every installed package's entry point of the group ``restkv.parts`` (declared in that package's
metadata, e.g. ``[project.entry-points."restkv.parts"] my_method = "my_package.scorers"``). A
source that fails to import or registers nothing is refused with one ``PluginError`` naming it.
Loading is idempotent within a process; a plugin file whose content changed since it was loaded
is loaded again, its old parts removed first.

Each plugin is recorded with the sha256 of its source (the file's bytes; a module's own source
file, or every ``.py`` file of a package), so a results folder can refuse to resume predictions
made by other code of the same method (``plugins_used``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterable, Sequence

from restkv.config.options import KINDS, ConfigError, names, registered, unregister

#: the entry-point group an installed package declares its parts under
ENTRY_POINT_GROUP = "restkv.parts"


class PluginError(ConfigError):
    """A plugin failed to import or registered no part; the message names it."""


@dataclass(frozen=True)
class Plugin:
    """A loaded plugin: what it was loaded from, the sha256 of its source, the parts it registered."""

    source: str
    files: tuple[Path, ...]
    sha256: str
    parts: tuple[tuple[str, str], ...]  # (kind, name)

    def record(self) -> dict[str, Any]:
        """What a results folder records of it."""
        return {"files": [str(path) for path in self.files], "sha256": self.sha256}


_LOADED: dict[str, Plugin] = {}


def load_plugins(sources: Iterable[str] = (), entry_points: bool = True) -> list[Plugin]:
    """Import every source (a path to a ``.py`` file or a module name), then with ``entry_points``
    every installed ``restkv.parts`` entry point; the plugins, in that order."""
    loaded = [load_plugin(source) for source in dict.fromkeys(sources)]
    if entry_points:
        for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            loaded.append(_load(f"entry point {point.name} ({point.value})", lambda point=point: _entry_module(point)))
    return loaded


def load_plugin(source: str) -> Plugin:
    """One plugin: a ``.py`` file (a path; it need not be importable) or an importable module name."""
    if source.endswith(".py") or Path(source).is_file():
        path = Path(source).resolve()
        if not path.is_file():
            raise PluginError(f"--plugin {source}: no such file")
        return _load(str(path), lambda: _file_module(path), changed=lambda old: _digest([path]) != old.sha256)
    return _load(source, lambda: importlib.import_module(source))


def plugins_used(parts: Sequence[Any]) -> dict[str, dict[str, Any]]:
    """The loaded plugins that registered a class of ``parts`` (a config's active parts), by source:
    what a run's predictions depend on beyond the package's own code."""
    active = {(kind, cls.name) for kind in KINDS for cls in registered(kind) if cls in {type(part) for part in parts}}
    return {plugin.source: plugin.record() for plugin in _LOADED.values() if active & set(plugin.parts)}


def _load(source: str, importer: Callable[[], ModuleType],
          changed: Callable[[Plugin], bool] = lambda old: False) -> Plugin:
    """Import ``source`` once (again when ``changed``), recording the parts it registered."""
    previous = _LOADED.get(source)
    if previous is not None and not changed(previous):
        return previous
    if previous is not None:  # an edited file: its parts are registered again by the new code
        for kind, name in previous.parts:
            unregister(kind, name)
    before = {kind: set(names(kind)) for kind in KINDS}
    try:
        module = importer()
    except PluginError:
        raise
    except Exception as error:  # any error of foreign code: one line naming the plugin
        raise PluginError(f"plugin {source} failed to import: {type(error).__name__}: {error}") from error
    parts = tuple((kind, name) for kind in KINDS for name in names(kind) if name not in before[kind])
    if not parts:
        raise PluginError(f"plugin {source} registered no part (a plugin registers a method, allocation, merge, "
                          "switch or quantization with restkv.config.options.register)")
    files = _source_files(module)
    plugin = Plugin(source, files, _digest(files), parts)
    _LOADED[source] = plugin
    return plugin


def _file_module(path: Path) -> ModuleType:
    """Execute a plugin file as a module of its own (a name no import can collide with)."""
    name = f"restkv_plugin_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve a class's module while it is executed
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _entry_module(point: importlib.metadata.EntryPoint) -> ModuleType:
    """The module an entry point names (importing it registers its parts)."""
    point.load()
    return sys.modules[point.module]


def _source_files(module: ModuleType) -> tuple[Path, ...]:
    """The module's source file, or every ``.py`` file of a package."""
    file = getattr(module, "__file__", None)
    if file is None:
        return ()
    path = Path(file).resolve()
    if path.name == "__init__.py":
        return tuple(sorted(path.parent.rglob("*.py")))
    return (path,)


def _digest(files: Sequence[Path]) -> str:
    """sha256 over the files' names and contents (a package's files, renamed or moved, differ)."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
