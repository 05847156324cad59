"""Every offline tool reads its flags from ``--config FILE`` as the runners and scripts do: the command line
overrides the file, and an unknown key stops the tool in one line before any model loads."""

from __future__ import annotations

import importlib

import pytest

from restkv.benchmarks.config_file import parse_command_line

TOOLS = {
    "head_scores": ("model_path: smollm2-135m\nseed: 3\n", {"seed": 3}),
    "duo_pattern": ("model_path: smollm2-135m\nnum_texts: 3\n", {"num_texts": 3}),
    "query_stats": ("model_path: smollm2-135m\nn_sink: 2\n", {"n_sink": 2}),
    "train_indexmem": ("model_path: smollm2-135m\nthreads: 2\n", {"threads": 2}),
}


@pytest.mark.parametrize("tool", TOOLS)
def test_each_tool_reads_a_config_file_under_its_command_line(tool, tmp_path, capsys):
    module = importlib.import_module(f"restkv.tools.{tool}")
    in_file, expected = TOOLS[tool]
    config = tmp_path / "flags.yaml"
    config.write_text(in_file)
    args, _ = parse_command_line(module.build_parser, ["--config", str(config), "--model_path", "gemma3-270m"])
    # the file's values, and the command line's --model_path over the file's
    wanted = {**expected, "model_path": "gemma3-270m"}
    assert {name: getattr(args, name) for name in wanted} == wanted

    config.write_text("no_such_flag: 1\n")
    with pytest.raises(SystemExit) as stop:
        module.main(["--config", str(config)])
    assert stop.value.code == 2 and f"--config {config}: unknown key(s) no_such_flag" in capsys.readouterr().err
