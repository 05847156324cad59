"""``--config FILE``, ``--plugin`` and the method-scoped ``--help`` of every runner."""

from __future__ import annotations

import json
import re
import textwrap

import pytest
from toy_benchmark import TOY

from restkv.benchmarks import flags, ruler
from restkv.benchmarks.run_folder import META_FILE
from restkv.config import plugins as plugins_module
from restkv.config.options import option_specs
from restkv.policies import SnapKV

PLUGIN = '''
"""Keeps the tokens whose keys have the smallest norm, raised to a power."""

from dataclasses import dataclass

from restkv.config.options import option, register
from restkv.policies import Policy


@register("method")
@dataclass(frozen=True)
class PluginNorm(Policy):
    name = "plugin_norm"

    plugin_exponent: float = option({exponent}, "exponent applied to the key norm", minimum=0, exclusive_minimum=True)

    def score(self, ctx):
        return -ctx.key.float().norm(dim=-1) ** self.plugin_exponent
'''


#: each test loads its plugins anew and leaves no part registered behind (conftest.py)
pytestmark = pytest.mark.usefixtures("fresh_plugins")


def write_plugin(tmp_path, exponent: float = 1.0):
    path = tmp_path / "plugin_norm.py"
    path.write_text(textwrap.dedent(PLUGIN.format(exponent=exponent)))
    return path


def stopped(call, capsys) -> tuple[int | str, str]:
    """The exit status (or one-line message) and stderr of a command that must stop."""
    with pytest.raises(SystemExit) as stop:
        call()
    return stop.value.code, capsys.readouterr().err


def flags_in_help(argv: list[str], capsys) -> tuple[set[str], str]:
    """The flags a help lists, and its text."""
    with pytest.raises(SystemExit) as stop:
        flags.parse_args(TOY, argv)
    assert stop.value.code == 0
    text = capsys.readouterr().out
    return set(re.findall(r"^  (--[a-z_-]+|-h)", text, flags=re.MULTILINE)), " ".join(text.split())


# ----------------------------------------------------------------------------- help


def test_help_shows_the_common_flags_and_the_chosen_methods_options(capsys):
    shown, text = flags_in_help(["--method", "snapkv", "--help"], capsys)
    assert len(shown) <= 60
    assert set(f"--{name}" for name in option_specs(SnapKV)) <= shown
    assert {"--config", "--plugin", "--help-all", "--residual", "--max_capacity_prompts", "--num_samples"} <= shown
    assert "--alpha" not in shown and "--residual_ratios" not in shown  # restkv's, and --residual's
    assert "--method snapkv, uniform allocation" in text and "--help-all" in text and "example:" in text
    assert "attention kernel (default: sdpa)" in text
    assert "llama-2: 3950" in text and "default_model_max_len" not in text  # in words, not a function's name
    default, default_text = flags_in_help(["--help"], capsys)
    assert default == shown and "Compression options of another method: --method NAME --help" in default_text


def test_help_adds_the_parts_given_and_help_all_shows_every_flag(capsys):
    shown, text = flags_in_help(["--method", "snapkv", "--residual", "--merge", "pivot", "--allocation", "adakv",
                                 "--help"], capsys)
    assert {"--residual_ratios", "--floor"} <= shown and "--method snapkv, adakv allocation, pivot merge" in text
    every, _ = flags_in_help(["--help-all"], capsys)
    assert {"--alpha", "--residual_ratios", "--nbits", "--cam_mode"} <= every and len(every) > 150


def test_every_flag_parses_whatever_the_help_shows():
    args = flags.parse_args(TOY, ["--method", "snapkv", "--max_capacity_prompts", "64", "--nbits", "4",
                                  "--quant_method", "kivi"])
    assert flags.compression_config_from_args(args).quantizer.nbits == 4


# ----------------------------------------------------------------------------- config files


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_config_file_gives_flags_and_the_command_line_overrides_them(tmp_path, suffix):
    values = {"method": "snapkv", "max_capacity_prompts": 64, "window_size": 8, "datasets": ["logs", "other"],
              "query_agnostic": True, "num_samples": 3, "kernel_size": None}
    path = tmp_path / f"run{suffix}"
    path.write_text(json.dumps(values))  # JSON is YAML too
    args = flags.parse_args(TOY, ["--config", str(path), "--window_size", "16"])
    assert (args.method, args.max_capacity_prompts, args.window_size) == ("snapkv", 64, 16)
    assert (args.datasets, args.query_agnostic, args.max_num_examples, args.kernel_size) == (
        ["logs", "other"], True, 3, None)
    ratio = flags.parse_args(TOY, ["--config", str(path), "--no-query_agnostic", "--max_capacity_prompts", "32"])
    assert ratio.query_agnostic is False and ratio.max_capacity_prompts == 32


@pytest.mark.parametrize("content, name, message", [
    ("method: snapkv\nbudgets: [128]\n", "sweep.yaml", "unknown key(s) budgets: not flags of"),
    ("method: snapkv\nwindow_sise: 8\n", "typo.yaml", "window_sise (did you mean window_size?)"),
    ("method: [snapkv\n", "broken.yaml", "not valid YAML"),
    ("{\"method\": }", "broken.json", "not valid JSON"),
    ("- snapkv\n", "list.yaml", "holds a list; a config file is a mapping"),
    ("method: snapkv\n", "run.toml", "give a .json, .yaml or .yml file"),
    (None, "missing.yaml", "no such file"),
    ("window_size: eight\n", "value.yaml", "argument --window_size: invalid int value: 'eight'"),
    ("query_agnostic: 3\n", "switch.yaml", "query_agnostic: takes true or false; got 3"),
    ("plugin: [no_such_plugin_module]\n", "plugin.yaml", "plugin no_such_plugin_module failed to import"),
])
def test_a_bad_config_file_is_one_line_naming_it_and_exit_status_2(tmp_path, capsys, content, name, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    code, err = stopped(lambda: flags.parse_args(TOY, ["--config", str(path), "--save_dir", str(tmp_path / "out")]),
                        capsys)
    error_line = err.strip().splitlines()[-1]
    assert code == 2 and message in error_line and (name in error_line or "plugin" in name), err
    assert not (tmp_path / "out").exists()


def test_a_run_meta_of_another_benchmark_is_refused(tmp_path, capsys):
    meta = tmp_path / META_FILE
    meta.write_text(json.dumps({"settings": {"benchmark": "longbench"}, "args": {}, "flags": {"method": "snapkv"}}))
    code, err = stopped(lambda: flags.parse_args(TOY, ["--config", str(meta)]), capsys)
    assert code == 2 and f"--config {meta} is the run_meta.json of a longbench run; this command runs toy" in err


# ----------------------------------------------------------------------------- a plugin through run_ruler.py


def ruler_argv(ruler_dir, save_dir, *extra):
    return ["--data_dir", str(ruler_dir), "--context_lengths", "600", "--datasets", "niah_single_1",
            "--max_capacity_prompts", "64", "--window_size", "8", "--max_new_tokens", "2", "--save_dir", str(save_dir),
            *extra]


def test_a_plugin_method_runs_through_run_ruler_and_is_refused_after_its_file_changes(tiny, tokenizer, ruler_dir,
                                                                                       tmp_path, capsys):
    plugin = write_plugin(tmp_path)
    argv = ruler_argv(ruler_dir, tmp_path / "out", "--plugin", str(plugin), "--method", "plugin_norm",
                      "--plugin_exponent", "2")
    folder = ruler.run(argv, model=tiny, tokenizer=tokenizer)
    predictions = [json.loads(line) for line in (folder / "600" / "niah_single_1.jsonl").read_text().splitlines()]
    assert len(predictions) == 2 and all(record["kv_layers_compressed"] > 0 for record in predictions)
    meta = json.loads((folder / META_FILE).read_text())
    assert meta["settings"]["plugins"][str(plugin.resolve())]["sha256"] == plugins_module._LOADED[
        str(plugin.resolve())].sha256
    assert meta["settings"]["config"]["plugin_exponent"] == 2.0
    assert ruler.run(argv, model=tiny, tokenizer=tokenizer) == folder  # unchanged code resumes

    write_plugin(tmp_path, exponent=3.0)  # the method's code changes; its flags do not
    code, _ = stopped(lambda: ruler.run(argv, model=tiny, tokenizer=tokenizer), capsys)
    assert isinstance(code, str) and code.startswith("error: ") and "\n" not in code
    assert f"holds predictions of plugin {plugin.resolve()} as it was" in code and "changed since" in code

    # the folder's run_meta.json is a config of run_ruler.py: the same flags, so the same folder and settings
    write_plugin(tmp_path)
    rerun = flags.parse_args(ruler.BENCHMARK, ["--config", str(folder / META_FILE)], ruler.add_flags)
    assert rerun.command_flags == meta["flags"] and "num_shards" not in meta["flags"]
    assert ruler.run(["--config", str(folder / META_FILE)], model=tiny, tokenizer=tokenizer) == folder


# ----------------------------------------------------------------------------- the sweep


def test_the_sweep_takes_a_config_file_plugins_and_the_sample_counts_release_name(tmp_path, capsys):
    from restkv.benchmarks import sweep

    plugin = write_plugin(tmp_path)
    config = tmp_path / "sweep.yaml"
    config.write_text(f"methods: [snapkv, plugin_norm]\ncompression_ratios: [0.9]\nplugin: [{plugin}]\n"
                      f"save_dir: {tmp_path / 'out'}\n")
    args = sweep.parse_args(["--config", str(config), "--budgets", "128", "--max_num_examples", "3"])
    assert (args.methods, args.budgets, args.num_samples, args.plugin) == (
        ["snapkv", "plugin_norm"], [128], 3, [str(plugin)])
    runner = sweep.runner_args(args, "plugin_norm", ["--max_capacity_prompts", "128"], False)
    assert runner.method == "plugin_norm" and runner.command_flags["plugin"] == [str(plugin)]
    meta = tmp_path / META_FILE
    meta.write_text(json.dumps({"settings": {"benchmark": "ruler"}, "args": {}, "flags": {}}))
    with pytest.raises(SystemExit) as stop:
        sweep.parse_args(["--config", str(meta)])
    assert stop.value.code == 2 and "is a results folder's run_meta.json (a ruler run); give it to the runner" in \
        capsys.readouterr().err
