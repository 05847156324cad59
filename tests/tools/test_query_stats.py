"""The query statistics command and --ea_stats: Expected Attention with offline query statistics."""

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import (assert_refused_when_configured, greedy, random_prompt, random_qkv, replace_for, rope_tables,
                         tiny_model)

from restkv import CompressionConfig, ConfigError, compress_kv
from restkv.cache import kept_positions
from restkv.integrations.transformers.compat import output_cache
from restkv.tools.query_stats import main


def test_statistics_equal_to_the_prompts_own_keep_what_the_prompt_keeps(tmp_path):
    """The prompt's pre-RoPE queries after the sinks, divided by n as Expected Attention does."""
    from restkv.scoring.rope import unrotate

    query, key, value = random_qkv(length=60, seed=91)
    rotary = rope_tables(query)
    plain = unrotate(query, *rotary)[0, :, 4:].float()
    mean = plain.mean(dim=1)
    cov = (plain - mean[:, None]).transpose(1, 2) @ (plain - mean[:, None]) / plain.shape[1]
    save_file({"query_mean": mean[None].contiguous(), "query_cov": cov[None].contiguous()}, str(tmp_path / "s.st"))
    options = dict(method="expected_attention", max_capacity_prompts=20, window_size=0)
    own = compress_kv(query, key, value, options, rotary=rotary)
    offline = compress_kv(query, key, value, dict(options, ea_stats=str(tmp_path / "s.st")), rotary=rotary)
    assert torch.equal(own.indices, offline.indices)


def test_bad_statistics_files_are_refused_with_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="--ea_stats .* is not a file"):
        CompressionConfig(method="expected_attention", max_capacity_prompts=20, ea_stats=str(tmp_path / "none"))
    save_file({"query_mean": torch.zeros(2, 4, 16)}, str(tmp_path / "half.st"))
    with pytest.raises(ConfigError, match="--ea_stats .*half.st.*: must hold query_mean"):
        CompressionConfig(method="expected_attention", max_capacity_prompts=20, ea_stats=str(tmp_path / "half.st"))
    save_file({"query_mean": torch.zeros(2, 4, 16), "query_cov": torch.zeros(2, 4, 16, 16)}, str(tmp_path / "s.st"))
    assert_refused_when_configured(dict(method="expected_attention", max_capacity_prompts=20, window_size=4,
                                        ea_stats=str(tmp_path / "s.st")),
                                   r"--ea_stats .*s.st.*: query_mean is \[2, 4, 16\]; the model needs \[3, 4, 16\]")


@pytest.mark.parametrize("cov, message", [
    (-100 * torch.eye(16), r"query_cov of layer 0, head 0 is not positive semi-definite \(an eigenvalue -100\)"),
    (torch.eye(16) + torch.triu(torch.ones(16, 16), diagonal=1), "query_cov of layer 0, head 0 is not symmetric"),
    (torch.full((16, 16), float("nan")), "query_cov holds NaN"),
])
def test_statistics_whose_covariance_is_no_covariance_are_refused_when_the_config_is_built(tmp_path, cov, message):
    good = torch.randn(50, 16, generator=torch.Generator().manual_seed(0))
    covariances = (good.T @ good / 50).expand(2, 4, 16, 16).clone()
    covariances[0, 0] = cov
    save_file({"query_mean": torch.zeros(2, 4, 16), "query_cov": covariances}, str(tmp_path / "bad.st"))
    with pytest.raises(ConfigError, match=f"--ea_stats .*bad.st.*: {message}"):
        CompressionConfig(method="expected_attention", max_capacity_prompts=20, ea_stats=str(tmp_path / "bad.st"))


def test_the_command_writes_statistics_expected_attention_reads(tokenizer, tmp_path):
    folder = tmp_path / "tiny"
    model = tiny_model("llama", vocab_size=len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = main(["--model_path", str(folder), "--out", str(tmp_path / "stats.safetensors"), "--num_texts", "2",
                "--text_length", "40"])
    replace_for("llama")(method="expected_attention", max_capacity_prompts=20, ea_stats=str(out), window_size=4)
    cache = output_cache(greedy(model, random_prompt(1, 60), new_tokens=1))
    assert all(len(head) == 20 for layer in kept_positions(cache) for head in layer.exact[0])


def test_the_command_refuses_bad_flags():
    with pytest.raises(SystemExit) as stop:
        main(["--model_path", "smollm2-135m", "--text_length", "10", "--n_sink", "9"])
    assert stop.value.code == "error: --n_sink 9 leaves fewer than 2 queries of a 10-token text"


def test_an_output_path_that_cannot_be_written_is_refused_before_the_model_loads(no_model_loading, tmp_path):
    """It was a safetensors traceback after every text had been run (R3)."""
    from test_command_lines import one_line_error

    (tmp_path / "a_file").write_text("")
    for out, message in ((tmp_path, f"--out {tmp_path}: a folder; give a file path"),
                         (tmp_path / "a_file" / "s.safetensors", f"{tmp_path / 'a_file'} is a file")):
        assert message in one_line_error(lambda: main(["--model_path", "smollm2-135m", "--out", str(out)]))


@pytest.mark.parametrize("family, message", [
    # GPT-2 has no .layers (an AttributeError, R4) and an attention restkv does not serve
    ("gpt2", "model type 'gpt2' is not supported by restkv: GPT2Attention needs an attention that"),
    # Cohere 2's interleaved RoPE cannot be undone: a ValueError traceback
    ("cohere2", "no pre-RoPE queries and keys: cohere2 layer 0 rotates them in a way restkv does not undo"),
])
def test_a_model_whose_queries_restkv_cannot_read_is_one_error_line(family, message, tiny_folder_of, tmp_path):
    from test_command_lines import one_line_error

    folder = tiny_folder_of(family)
    error = one_line_error(lambda: main(["--model_path", str(folder), "--num_texts", "1", "--text_length", "32",
                                         "--out", str(tmp_path / "stats.safetensors")]))
    assert message in error and not (tmp_path / "stats.safetensors").exists()
