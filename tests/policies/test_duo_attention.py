"""DuoAttention (--method duo_attention): streaming heads keep sinks + recent tokens, retrieval heads
everything, chosen from a pattern file that python -m restkv.tools.duo_pattern computes."""

import json

import numpy as np
import pytest
import torch
from tiny_models import greedy, random_prompt, random_qkv, replace_for, tiny_model

import restkv
from restkv import CompressionConfig, ConfigError, compress_kv
from restkv.allocations.duo import read_duo_pattern, streaming_heads
from restkv.cache import kept_positions
from restkv.integrations.transformers.compat import output_cache
from restkv.integrations.transformers.duo_scores import head_scores_of
from restkv.tools.duo_pattern import main


def write_pattern(path, scores, **sizes):
    path.write_text(json.dumps({"head_scores": scores, **sizes}))
    return str(path)


def test_the_lowest_scored_share_of_the_models_heads_stream():
    scores = np.array([[0.2, 0.9], [0.1, 0.5], [0.7, 0.3]])
    assert streaming_heads(scores, 0.5).tolist() == [[True, False], [True, False], [False, True]]
    assert not streaming_heads(scores, 0.0).any() and streaming_heads(scores, 1.0).all()


def test_streaming_heads_keep_sinks_and_recent_tokens_and_retrieval_heads_everything(tmp_path):
    pattern = write_pattern(tmp_path / "p.json", [[0.9, 0.1], [0.2, 0.8]])
    query, key, value = random_qkv(length=100, seed=61)
    options = dict(method="duo_attention", max_capacity_prompts=30, n_sink=6, duo_pattern=pattern,
                   duo_streaming_ratio=0.5)
    for layer, streaming in ((0, 1), (1, 0)):
        out = compress_kv(query, key, value, options, layer_idx=layer, num_layers=2)
        heads = [set(i for i in out.indices[0, head].tolist() if i >= 0) for head in range(2)]
        assert heads[streaming] == set(range(6)) | set(range(76, 100))
        assert heads[1 - streaming] == set(range(100))


def test_the_pattern_file_is_checked_before_any_model_runs(tmp_path):
    with pytest.raises(ConfigError, match="--allocation duo needs --duo_pattern FILE .* or --duo_on_the_fly$"):
        CompressionConfig(method="duo_attention", max_capacity_prompts=30)
    with pytest.raises(ConfigError, match="--duo_pattern .* is not a file"):
        CompressionConfig(method="duo_attention", max_capacity_prompts=30, duo_pattern=str(tmp_path / "none.json"))
    (tmp_path / "bad.json").write_text(json.dumps({"scores": [1]}))
    with pytest.raises(ConfigError, match="--duo_pattern .*bad.json.*: a DuoAttention pattern .*'head_scores'"):
        CompressionConfig(method="duo_attention", max_capacity_prompts=30, duo_pattern=str(tmp_path / "bad.json"))
    pattern = write_pattern(tmp_path / "p.json", [[0.9, 0.1]])
    with pytest.raises(ConfigError, match="--allocation duo keeps each head's prefill count; --prefill_chunk_size"):
        CompressionConfig(method="duo_attention", max_capacity_prompts=30, duo_pattern=pattern, prefill_chunk_size=64)
    with pytest.raises(ConfigError, match="scores 1 layers x 2 KV heads; the model has 3 x 2"):
        with restkv.compression(tiny_model("llama"), method="duo_attention", max_capacity_prompts=30,
                                duo_pattern=pattern):
            pass


def test_duoattentions_own_tsv_pattern_is_read_and_clipped(tmp_path):
    (tmp_path / "full_attention_heads.tsv").write_text("1.2\t0.3\n-0.1\t0.5\n")
    assert read_duo_pattern(str(tmp_path / "full_attention_heads.tsv")).tolist() == [[1.0, 0.3], [0.0, 0.5]]


def test_the_model_stores_each_heads_own_count(tmp_path):
    model = tiny_model("llama")
    pattern = write_pattern(tmp_path / "p.json", [[0.9, 0.1], [0.2, 0.8], [0.5, 0.6]])
    replace_for("llama")(method="duo_attention", max_capacity_prompts=30, n_sink=4, duo_pattern=pattern)
    cache = output_cache(greedy(model, random_prompt(1, 90), new_tokens=1))
    counts = [[len(head) for head in layer.exact[0]] for layer in kept_positions(cache)]
    assert counts == [[90, 30], [30, 90], [30, 90]]


def test_head_score_is_the_area_under_the_cumulative_attention_curve():
    """Without rotation every repeated key is the same: uniform attention, area (n + 1) / 2n."""
    span = 10
    rotary = (torch.ones(1, span, 8), torch.zeros(1, span, 8))
    area = head_scores_of(torch.randn(4, 8), torch.randn(2, 8), rotary, 0.35)
    torch.testing.assert_close(area, torch.full((2,), (span + 1) / (2 * span)))


def test_the_pattern_command_writes_a_file_the_method_reads(tokenizer, tmp_path):
    folder = tmp_path / "tiny"
    model = tiny_model("llama", vocab_size=len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = main(["--model_path", str(folder), "--out", str(tmp_path / "duo.json"), "--num_texts", "2", "--span", "24"])
    data = json.loads(out.read_text())
    assert (data["sink_size"], data["recent_size"]) == (128, 256)
    scores = read_duo_pattern(str(out))
    assert scores.shape == (3, 2) and ((scores > 0) & (scores < 1)).all()
    replace_for("llama")(method="duo_attention", max_capacity_prompts=20, duo_pattern=str(out))
    cache = output_cache(greedy(model, random_prompt(1, 60), new_tokens=1))
    assert sorted(len(head) for layer in kept_positions(cache) for head in layer.exact[0]) == [20, 20, 20, 60, 60, 60]


def test_the_pattern_command_refuses_bad_flags():
    with pytest.raises(SystemExit) as stop:
        main(["--model_path", "smollm2-135m", "--span", "1"])
    assert stop.value.code == "error: --span must be at least 2 positions; got 1"


def test_the_shipped_smollm2_pattern_covers_every_kv_head():
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[2] / "data" / "duo_patterns" / "smollm2-135m.json"
    assert read_duo_pattern(str(shipped)).shape == (30, 3)
    assert json.loads(shipped.read_text())["made_with"].startswith("python -m restkv.tools.duo_pattern")


def test_the_pattern_commands_output_path_is_checked_before_the_model_loads(no_model_loading, tmp_path):
    from test_command_lines import one_line_error

    message = one_line_error(lambda: main(["--model_path", "smollm2-135m", "--out", str(tmp_path)]))
    assert message == f"error: --out {tmp_path}: a folder; give a file path"


def test_the_pattern_command_on_a_rope_it_cannot_undo_is_one_error_line(tiny_folder_of, tmp_path):
    """Cohere 2's interleaved RoPE: a ValueError traceback after the model had loaded (R5)."""
    from test_command_lines import one_line_error

    message = one_line_error(lambda: main(["--model_path", str(tiny_folder_of("cohere2")), "--num_texts", "1",
                                           "--span", "16", "--out", str(tmp_path / "duo.json")]))
    assert message.startswith("error: no pre-RoPE queries and keys: cohere2 layer 0 rotates them")


def test_the_pattern_reads_queries_and_keys_after_the_qk_norms_unless_told_to_skip_them(tokenizer):
    """By default the mean query and key are the ones attention computes (after Qwen 3's q/k norms);
    ``--no-qk_norm`` reads them as kvpress' on-the-fly scoring does, which meant to apply the norms
    of Gemma 3 and Qwen 3 but tests the decoder layer, not its attention, so never does."""
    from restkv.integrations.transformers.duo_scores import compute_pattern
    from restkv.integrations.transformers.projections import pre_rope_projections

    model = tiny_model("qwen3")
    ids = random_prompt(1, 24)
    hidden = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: hidden.__setitem__(module.layer_idx, kwargs["hidden_states"]), with_kwargs=True)
        for layer in model.model.layers]
    normed, plain = pre_rope_projections(model, ids), pre_rope_projections(model, ids, qk_norm=False)
    for hook in hooks:
        hook.remove()
    for index, layer in enumerate(model.model.layers):
        attention, states = layer.self_attn, hidden[index]
        query = attention.q_proj(states).view(1, 24, -1, attention.head_dim).transpose(1, 2)[0]
        key = attention.k_proj(states).view(1, 24, -1, attention.head_dim).transpose(1, 2)[0]
        torch.testing.assert_close(plain[index].query, query.float())
        torch.testing.assert_close(plain[index].key, key.float())
        torch.testing.assert_close(normed[index].query, attention.q_norm(query).float())
        torch.testing.assert_close(normed[index].key, attention.k_norm(key).float())
    texts = [random_prompt(1, 24)[0].tolist()]
    assert not torch.allclose(compute_pattern(model, texts, 24), compute_pattern(model, texts, 24, qk_norm=False))
    llama = tiny_model("llama")  # no q/k norms: the switch changes nothing
    torch.testing.assert_close(compute_pattern(llama, texts, 24), compute_pattern(llama, texts, 24, qk_norm=False))


# ---------------------------------------------------------------- scored on the fly (--duo_on_the_fly)
@pytest.fixture(scope="module")
def tiny_with_tokenizer(tokenizer, tmp_path_factory):
    """A tiny Llama saved with the embedded tokenizer and loaded back, so its name_or_path names both."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("duo") / "tiny"
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()


def kvpress_on_the_fly(model, texts: list[list[int]], span: int) -> torch.Tensor:
    """kvpress' duo_attention_on_the_fly formula, written out on a Llama: each layer's mean query and key of the
    normed hidden states, repeated over ``span`` positions and rotated by the model's rotary embedding, the last
    query's softmax over the keys (scaled by 1 / sqrt(d)), the mean of its cumulative sum, averaged per group."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    config = model.config
    groups = config.num_attention_heads // config.num_key_value_heads
    scores = torch.zeros(config.num_hidden_layers, config.num_key_value_heads)
    positions = torch.arange(span)[None]
    for ids in texts:
        with torch.no_grad():
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[:-1]
            for index, states in enumerate(hidden):
                layer = model.model.layers[index]
                d = layer.self_attn.head_dim
                states = layer.input_layernorm(states)
                query = layer.self_attn.q_proj(states).view(1, len(ids), -1, d).mean(dim=1, keepdim=True)
                key = layer.self_attn.k_proj(states).view(1, len(ids), -1, d).mean(dim=1, keepdim=True)
                query = query.repeat(1, span, 1, 1).transpose(1, 2)
                key = key.repeat(1, span, 1, 1).transpose(1, 2)
                cos, sin = model.model.rotary_emb(states, positions)
                query, key = apply_rotary_pos_emb(query, key, cos, sin)
                key = key.repeat_interleave(groups, dim=1)
                weights = (query[:, :, -1:] @ key.transpose(2, 3) / d**0.5).softmax(dim=-1).squeeze()
                scores[index] += torch.cumsum(weights, dim=1).mean(1).view(-1, groups).mean(1) / len(texts)
    return scores


def test_on_the_fly_scores_are_kvpress_formula_on_a_tiny_llama(tiny_with_tokenizer, tokenizer):
    from restkv.integrations.transformers.duo_scores import compute_pattern
    from restkv.learned.training_text import training_sequences

    model = tiny_with_tokenizer[1]
    texts = training_sequences(tokenizer, 3, 64, 0)
    torch.testing.assert_close(compute_pattern(model, texts, 64), kvpress_on_the_fly(model, texts, 64),
                               rtol=1e-5, atol=1e-6)


def test_on_the_fly_scores_are_the_pattern_commands_computed_once_per_model(tiny_with_tokenizer, tmp_path,
                                                                             monkeypatch):
    from restkv.integrations.transformers import duo_scores

    folder, model = tiny_with_tokenizer
    offline = json.loads(main(["--model_path", str(folder), "--out", str(tmp_path / "duo.json")]).read_text())
    options = dict(method="duo_attention", max_capacity_prompts=20, n_sink=4, duo_on_the_fly=True)
    with restkv.compression(model, **options) as config:
        cache = output_cache(greedy(model, random_prompt(1, 60), new_tokens=1))
    pattern = json.loads(open(config.allocator.duo_pattern).read())
    assert pattern["head_scores"] == offline["head_scores"]
    assert (pattern["sink_size"], pattern["recent_size"]) == (128, 256)
    assert pattern["made_with"].startswith(f"restkv --duo_on_the_fly for {folder}")
    assert config == CompressionConfig(**{**options, "duo_on_the_fly": False}, duo_pattern=config.allocator.duo_pattern)
    streaming = streaming_heads(np.array(offline["head_scores"]), 0.5)
    counts = [[len(head) for head in layer.exact[0]] for layer in kept_positions(cache)]
    assert counts == np.where(streaming, 20, 60).tolist()
    monkeypatch.setattr(duo_scores, "compute_pattern", lambda *args: pytest.fail("scored the model again"))
    with restkv.compression(model, CompressionConfig(**options)) as again:
        assert again == config


def test_on_the_fly_scoring_is_refused_where_it_cannot_run(tmp_path):
    options = dict(method="duo_attention", max_capacity_prompts=30, duo_on_the_fly=True)
    with pytest.raises(ConfigError, match=r"^--duo_on_the_fly scores the heads on text the model's tokenizer encodes; "
                                          r"none loads from its name_or_path '' \(.*\): give --duo_pattern FILE"):
        with restkv.compression(tiny_model("llama"), **options):
            pass
    with pytest.raises(ConfigError, match=r"^--duo_on_the_fly scores the heads from the model when the config is "
                                          r"given with it .*compress_kv\): give --duo_pattern FILE$"):
        compress_kv(*random_qkv(length=60), options, layer_idx=0, num_layers=2)
    pattern = write_pattern(tmp_path / "p.json", [[0.9, 0.1]])
    with pytest.raises(ConfigError, match=f"^--duo_on_the_fly scores the heads from the model; --duo_pattern {pattern} "
                                          "gives them: give one$"):
        CompressionConfig(**options, duo_pattern=pattern)
