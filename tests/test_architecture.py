"""docs/ARCHITECTURE.md holds true: every module under restkv/ is on its map, every module-level import goes
to its own layer or an earlier one, no module imports another back at module level (no cycle), the package
root names no part, and every kind of registered part lives in its own folder."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "restkv"
DOC = (ROOT / "docs" / "ARCHITECTURE.md").read_text()


def modules() -> dict[str, Path]:
    """``restkv.x.y`` -> its file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def layers() -> list[list[str]]:
    """The doc's layer table: per layer, in order, the paths it names (folders end with ``/``)."""
    section = DOC.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    return [re.findall(r"`(restkv/[^`]*)`", row.split("|")[2]) for row in rows]


def layer_of(path: Path) -> int:
    """The layer of a module: the layer naming the longest path that contains it."""
    relative = path.relative_to(ROOT).as_posix()
    best, index = "", None
    for number, names in enumerate(layers()):
        for name in names:
            if (relative == name or (name.endswith("/") and relative.startswith(name))) and len(name) > len(best):
                best, index = name, number
    if index is None:
        raise AssertionError(f"{relative} is in no layer of docs/ARCHITECTURE.md")
    return index


def module_level_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of the restkv modules ``path`` imports when it is imported (not inside a function, not
    under ``TYPE_CHECKING``): the edges of the import graph."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(body):
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("restkv"):
                found.append((node.lineno, node.module))
                if node.module == "restkv":  # ``from restkv import allocations``: the submodules
                    found.extend((node.lineno, f"restkv.{alias.name}") for alias in node.names)
            elif isinstance(node, ast.Import):
                found.extend((node.lineno, alias.name) for alias in node.names if alias.name.startswith("restkv"))
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit([*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                       *[handler for handler in getattr(node, "handlers", [])]])
            elif isinstance(node, ast.ExceptHandler):
                visit(node.body)

    visit(tree.body)
    return found


def test_every_module_is_on_the_map():
    """A module of the package that docs/ARCHITECTURE.md names nowhere (by its path, or a folder's glob)."""
    named = set(re.findall(r"`(restkv/[^`]*)`", DOC))
    missing = []
    for path in modules().values():
        relative = path.relative_to(ROOT).as_posix()
        if not any(relative == name or Path(relative).match(name) for name in named):
            missing.append(relative)
    assert not missing, f"not on docs/ARCHITECTURE.md's map: {missing}"


def test_every_import_goes_to_its_own_layer_or_an_earlier_one():
    table = modules()
    broken = []
    for name, path in table.items():
        mine = layer_of(path)
        for line, imported in module_level_imports(path):
            target = table.get(imported)
            if target is not None and layer_of(target) > mine:
                broken.append(f"{path.relative_to(ROOT)}:{line} imports {imported} (layer {layer_of(target) + 1} > "
                              f"{mine + 1})")
    assert not broken, "imports against docs/ARCHITECTURE.md's layer order:\n" + "\n".join(broken)


def test_no_module_imports_another_back():
    table = modules()
    graph = {name: {imported for _, imported in module_level_imports(path) if imported in table and imported != name}
             for name, path in table.items()}
    state: dict[str, int] = {}
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := walk(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := walk(node)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_the_package_root_names_no_part_and_each_kind_lives_in_one_folder():
    import restkv
    from restkv.config.options import KINDS, registered

    root = (PACKAGE / "__init__.py").read_text()
    for kind in KINDS:
        folders = {cls.__module__.split(".")[1] for cls in registered(kind)}
        assert len(folders) == 1, f"the {kind} parts live in {sorted(folders)}"
        for cls in registered(kind):
            assert cls.__name__ not in root, f"restkv/__init__.py names the {kind} {cls.__name__}"
    top_level = [path.name for path in PACKAGE.glob("*.py")]
    assert len(top_level) <= 10, f"{len(top_level)} modules directly under restkv/: {top_level}"
    assert restkv.available_methods()


def test_every_data_file_in_the_package_is_declared_as_package_data():
    """A file moved to another folder must still ship in the wheel, or an installed restkv loses it."""
    import tomllib

    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["restkv"]
    tracked = [path for path in PACKAGE.rglob("*") if path.is_file() and path.suffix not in {".py", ".pyc"}]
    for path in tracked:
        relative = path.relative_to(PACKAGE)
        assert any(relative.match(pattern) for pattern in globs), f"restkv/{relative} is not in package-data {globs}"
    assert tracked, "the package ships its learned weights"


def test_the_tests_mirror_the_package_folders():
    """A test folder is named after the part of the package it tests (``tests/switches`` ↔ ``restkv/switches``)."""
    folders = sorted(path.name for path in (ROOT / "tests").iterdir() if path.is_dir() and path.name != "__pycache__")
    assert folders, "the tests live in folders"
    for name in folders:
        assert (PACKAGE / name).is_dir(), f"tests/{name}/ names no folder of restkv/"


def test_one_layers_prefill_hands_the_cache_through_three_modules_in_a_straight_line():
    """Following the cache from the attention seam through one layer's prefill: the seam, the step chosen once from
    the cache's state, the one read of that state; no module is entered twice (the switchboard this replaced went
    back and forth between attention, deferred and handles)."""
    import sys

    from tiny_models import random_prompt, tiny_model
    from transformers import DynamicCache

    import restkv

    model = tiny_model("llama")
    cache = DynamicCache(config=model.config)
    calls: list[tuple[str, str]] = []

    def record(frame, event, arg):
        code = frame.f_code
        if event == "call" and f"{PACKAGE}/" in code.co_filename:
            arguments = [frame.f_locals.get(name) for name in code.co_varnames[:code.co_argcount]]
            if any(argument is cache for argument in arguments):
                calls.append((str(Path(code.co_filename).relative_to(PACKAGE)), code.co_name))

    with restkv.compression(model, method="snapkv", max_capacity_prompts=16, window_size=4):
        sys.setprofile(record)
        try:
            model(random_prompt(1, 50), cache=cache, use_cache=True)
        finally:
            sys.setprofile(None)
    layers = []
    for module, function in calls:
        if function == "_cache_layer":  # a layer's forward starts at the seam
            layers.append([])
        if layers and (not layers[-1] or layers[-1][-1] != module):
            layers[-1].append(module)
    assert len(layers) == model.config.num_hidden_layers
    for path in layers:
        assert len(path) == len(set(path)) <= 3, path
    assert layers[0] == ["integrations/transformers/attention.py", "integrations/transformers/steps.py",
                         "integrations/transformers/handles.py"]
