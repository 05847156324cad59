"""RESTKV_VLLM's reading and refusals, and the tensor-level selection the vLLM workers run: no vLLM needed, so
these run in the main suite and in the vLLM environment (where they also show ``import restkv`` works on the
transformers release vLLM pins)."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import restkv
from restkv.config import CompressionConfig
from restkv.integrations.vllm import register
from restkv.integrations.vllm.selection import select_kept
from restkv.integrations.vllm.settings import VllmSettingsError, check_model, read_settings

ROOT = Path(__file__).resolve().parents[3]


def test_unset_or_empty_means_no_compression():
    assert read_settings("") is None and read_settings("   ") is None


def test_the_budget_and_what_each_prompt_gives_back():
    ratio = read_settings(json.dumps({"method": "snapkv", "compression_ratio": 0.9}))
    assert ratio.kept_tokens(1500) == ratio.config.budget_for(1500) == 150
    assert ratio.evicted_tokens(1500) == 1350
    assert ratio.evicted_tokens(200) == 0  # 20 kept would not exceed the 32-token window: served whole
    fixed = read_settings(json.dumps({"method": "tova", "max_capacity_prompts": 64, "window_size": 8}))
    assert fixed.evicted_tokens(64) == 0 and fixed.evicted_tokens(65) == 1 and fixed.kept_tokens(1000) == 64


def test_a_json_file_holds_the_options(tmp_path):
    path = tmp_path / "restkv.json"
    path.write_text(json.dumps({"method": "keydiff", "max_capacity_prompts": 128}))
    assert read_settings(str(path)).config.run.method == "keydiff"


@pytest.mark.parametrize("text, says", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ("/no/such/restkv.json", "neither restkv options as JSON nor an existing file"),
    ('{"method": "snapkv", "compression_ratio": 0.9, "bogus": 1}', "unknown option(s) bogus"),
    ('{"method": "snapkvx", "compression_ratio": 0.9}', "is not a known method"),
    ('{"method": "snapkv"}', "needs a budget"),
    ('{"method": "fullkv"}', "evicts nothing"),
    ('{"method": "kvzip", "compression_ratio": 0.5}', "--observation reconstruction"),
    ('{"method": "restkv_recon", "compression_ratio": 0.5}', "--observation reconstruction"),
    ('{"method": "adakv", "compression_ratio": 0.5}', "--allocation adakv"),
    ('{"method": "pyramidkv", "compression_ratio": 0.5}', "--allocation pyramid"),
    ('{"method": "snapkv", "compression_ratio": 0.5, "residual": true}', "--residual"),
    ('{"method": "snapkv", "compression_ratio": 0.5, "quant_method": "kivi"}', "--quant_method"),
    ('{"method": "snapkv", "max_capacity_prompts": 64, "decode_budget": 128}', "--decode_budget"),
    ('{"method": "snapkv", "max_capacity_prompts": 64, "decode_compression_ratio": 0.5}',
     "--decode_compression_ratio"),
    ('{"method": "l2norm", "max_capacity_prompts": 64, "dms": true, "dms_threshold": -3.0, "dms_decoding": true}',
     "--dms_decoding"),
    ('{"method": "snapkv", "compression_ratio": 0.5, "prefilter": "l2norm", "prefilter_ratio": 0.3}',
     "--prefilter l2norm"),
    ('{"method": "kvzap", "compression_ratio": 0.5, "allocation": "uniform"}', "attention's input"),
    ('{"method": "expected_attention", "compression_ratio": 0.5}', "before RoPE"),
    ('{"method": "h2o", "compression_ratio": 0.5, "h2o_queries": "all"}', "every prompt token"),
    ('{"method": "finch", "compression_ratio": 0.5, "finch_delimiter": 7}', "--finch_delimiter 7 is taken out"),
    ('{"method": "duo_attention", "max_capacity_prompts": 64, "duo_on_the_fly": true}', "--allocation duo"),
])
def test_what_vllm_cannot_serve_is_refused_in_one_line_naming_it(text, says):
    with pytest.raises(VllmSettingsError) as refused:
        read_settings(text)
    message = str(refused.value)
    assert message.startswith("RESTKV_VLLM") and "\n" not in message and says in message, message


@pytest.mark.parametrize("method", ["snapkv", "restkv", "streamingllm", "h2o", "tova", "l2norm", "keydiff", "random"])
def test_served_methods_are_accepted(method):
    assert read_settings(json.dumps({"method": method, "compression_ratio": 0.8})).config.run.method == method


def test_models_the_paged_cache_cannot_compress_uniformly_are_refused():
    snapkv = read_settings('{"method": "snapkv", "compression_ratio": 0.5}')
    with pytest.raises(VllmSettingsError, match="sliding-window layers"):
        check_model(snapkv, 4, [None, 512, None, 512], "Gemma3ForCausalLM")
    skipping = read_settings('{"method": "l2norm", "compression_ratio": 0.5, "l2norm_skip_layers": [0, 1]}')
    with pytest.raises(VllmSettingsError, match=r"leaves layers \[0, 1\] whole"):
        check_model(skipping, 4, [None] * 4, "LlamaForCausalLM")
    check_model(snapkv, 4, [None] * 4, "LlamaForCausalLM")


@pytest.mark.parametrize("method", ["snapkv", "restkv", "streamingllm", "h2o", "tova", "l2norm", "keydiff", "random"])
def test_the_workers_selection_keeps_what_compress_kv_keeps(method):
    """vLLM's workers hand the pipeline a request's last window of queries, token-major; the kept positions and
    the gathered keys and values are the transformers path's (``compress_kv`` with every query)."""
    torch.manual_seed(0)
    length, heads, kv_heads, dim, window = 200, 6, 2, 16, 16
    query, key, value = torch.randn(1, heads, length, dim), torch.randn(1, kv_heads, length, dim), \
        torch.randn(1, kv_heads, length, dim)
    config = CompressionConfig.from_any({"method": method, "max_capacity_prompts": 48, "window_size": window})
    o_proj = torch.randn(32, heads * dim)
    expected = restkv.compress_kv(query, key, value, config, layer_idx=3, num_layers=8, o_proj_weight=o_proj)
    kept = select_kept(config, query[0, :, -window:].transpose(0, 1), key[0].transpose(0, 1),
                       value[0].transpose(0, 1), 48, layer_idx=3, num_layers=8, scaling=dim ** -0.5,
                       o_proj_weight=o_proj)
    assert torch.equal(kept.positions, expected.indices[0])
    assert torch.equal(kept.keys, expected.keys[0].transpose(0, 1))
    assert torch.equal(kept.values, expected.values[0].transpose(0, 1))


def test_the_plugin_is_declared_and_patches_nothing_while_the_variable_is_unset(monkeypatch):
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    assert entry == {"restkv": "restkv.integrations.vllm:register"}
    monkeypatch.delenv("RESTKV_VLLM", raising=False)
    loaded = set(sys.modules)
    register()
    assert not any(name.startswith("vllm") for name in set(sys.modules) - loaded)


def test_a_bad_variable_stops_the_plugin_with_one_line(monkeypatch):
    monkeypatch.setenv("RESTKV_VLLM", '{"method": "adakv", "compression_ratio": 0.5}')
    with pytest.raises(SystemExit) as stopped:
        register()
    assert str(stopped.value).startswith("error: RESTKV_VLLM: --allocation adakv") and "\n" not in str(stopped.value)


def test_the_benchmark_refuses_a_method_vllm_cannot_serve_before_any_engine():
    """``scripts/vllm_bench.py``'s flags are checked before any model or engine (seconds, no vLLM needed)."""
    done = subprocess.run([sys.executable, "scripts/vllm_bench.py", "--method", "kvzip"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().startswith("error: RESTKV_VLLM: --observation reconstruction")
    assert len(done.stderr.strip().splitlines()) == 1
