"""Plugins: parts registered by a file, a module or an installed package's entry point."""

from __future__ import annotations

import importlib.metadata
import textwrap

import pytest

from restkv.config import CompressionConfig, option_names
from restkv.config.options import names
from restkv.config.plugins import ENTRY_POINT_GROUP, PluginError, load_plugin, load_plugins, plugins_used

PLUGIN = '''
"""A method from outside the package."""

from dataclasses import dataclass

from restkv.config.options import option, register
from restkv.policies import Policy


@register("method")
@dataclass(frozen=True)
class {cls}(Policy):
    name = "{name}"

    {option}: float = option(1.0, "exponent of the key norm", minimum=0)

    def score(self, ctx):
        return -ctx.key.float().norm(dim=-1) ** self.{option}
'''


def plugin_source(name: str = "outside_norm", option: str = "outside_exponent") -> str:
    return textwrap.dedent(PLUGIN.format(cls="OutsideNorm", name=name, option=option))


#: each test loads its plugins anew and leaves no part registered behind (conftest.py)
pytestmark = pytest.mark.usefixtures("fresh_plugins")


def test_a_plugin_file_registers_its_method_and_its_options(tmp_path):
    path = tmp_path / "outside.py"
    path.write_text(plugin_source())
    plugin = load_plugin(str(path))
    assert plugin.parts == (("method", "outside_norm"),) and plugin.files == (path.resolve(),)
    assert "outside_exponent" in option_names()
    config = CompressionConfig(method="outside_norm", outside_exponent=2.0, max_capacity_prompts=64)
    assert config.policy.outside_exponent == 2.0
    assert load_plugin(str(path)) is plugin  # loaded once per process
    assert plugins_used(config.parts) == {str(path.resolve()): plugin.record()}
    assert plugins_used(CompressionConfig(method="snapkv", max_capacity_prompts=64).parts) == {}


def test_an_edited_plugin_file_is_loaded_again_with_another_hash(tmp_path):
    path = tmp_path / "outside.py"
    path.write_text(plugin_source())
    first = load_plugin(str(path))
    path.write_text(plugin_source(option="outside_power"))
    second = load_plugin(str(path))
    assert second.sha256 != first.sha256 and "outside_power" in option_names()
    assert "outside_exponent" not in option_names()  # the old code's option went with it


def test_a_module_plugin_and_an_entry_point(tmp_path, monkeypatch):
    (tmp_path / "outside_module.py").write_text(plugin_source())
    (tmp_path / "installed_parts.py").write_text(plugin_source("installed_norm", "installed_exponent")
                                                 .replace("OutsideNorm", "InstalledNorm"))
    monkeypatch.syspath_prepend(str(tmp_path))
    point = importlib.metadata.EntryPoint("installed", "installed_parts", ENTRY_POINT_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: [point] if group == ENTRY_POINT_GROUP else [])
    loaded = load_plugins(["outside_module"])
    assert [plugin.parts for plugin in loaded] == [(("method", "outside_norm"),), (("method", "installed_norm"),)]
    assert loaded[1].source == "entry point installed (installed_parts)"
    assert loaded[1].files == ((tmp_path / "installed_parts.py").resolve(),)
    assert {"outside_norm", "installed_norm"} <= set(names("method"))


@pytest.mark.parametrize("source, content, message", [
    ("broken.py", "import no_such_module_anywhere\n",
     "failed to import: ModuleNotFoundError: No module named 'no_such_module_anywhere'"),
    ("empty.py", "x = 1\n", "registered no part"),
    ("missing.py", None, "--plugin missing.py: no such file"),
    ("no_such_plugin_module", None, "plugin no_such_plugin_module failed to import: ModuleNotFoundError"),
])
def test_a_plugin_that_fails_or_registers_nothing_is_one_line_naming_it(tmp_path, monkeypatch, source, content,
                                                                         message):
    monkeypatch.chdir(tmp_path)
    if content is not None:
        (tmp_path / source).write_text(content)
    with pytest.raises(PluginError) as refused:
        load_plugin(source)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    if content is not None:
        assert str((tmp_path / source).resolve()) in str(refused.value)
