"""Compression during generation for every kind of scorer: a budget that is a share of the tokens seen
(--decode_compression_ratio), another method while decoding (--decode_method), scorers of each token alone
(scores taken as tokens come), and scorers that model the queries to come (the queries since the last
compression)."""

import pytest
import torch
from tiny_models import (assert_model_compresses, assert_rows_match_single_row_runs, greedy, random_prompt, replace_for,
                         surrogate_file, tiny_model)

from restkv import CompressionConfig, ConfigError, kept_positions
from restkv.cache import CompressedLayer
from restkv.config.composition import kept_at_ratio
from restkv.integrations.transformers.compat import CACHE_ARGUMENT, output_cache
from restkv.learned.kvzap import SHIPPED_SURROGATES
from restkv.pipeline.inputs import LayerInputs
from restkv.pipeline.plan import plan_layer
from restkv.policies.l2norm import L2Norm
from restkv.scoring.rope import rotate_half


def held_positions(cache) -> list[list[list[int]]]:
    """Per layer and KV head, the positions row 0 holds (kept and appended)."""
    return [[sorted(head) for head in kept.exact[0]] for kept in kept_positions(cache)]


def test_a_decode_compression_ratio_keeps_that_share_of_every_token_seen():
    model = tiny_model("llama")
    replace_for("llama")(method="snapkv", max_capacity_prompts=24, window_size=4, decode_compression_ratio=0.6,
                         decode_interval=5)
    compressions = []

    def record(module, args, kwargs, output):
        layer = kwargs[CACHE_ARGUMENT].layers[module.layer_idx]
        if layer.tail_length == 0:  # compressed this step
            compressions.append((layer.tokens_seen, int(layer.kept_counts.max()), int(layer.kept_counts.min())))

    handle = model.model.layers[1].self_attn.register_forward_hook(record, with_kwargs=True)
    greedy(model, random_prompt(1, 50), new_tokens=30)
    handle.remove()
    assert len(compressions) >= 4
    assert all(most == least == kept_at_ratio(seen, 0.6) for seen, most, least in compressions[1:])


def test_the_decode_method_scores_generation_and_the_method_the_prompt():
    """--method snapkv --decode_method l2norm: the prompt keeps SnapKV's set; each compression while decoding
    keeps the window and the held tokens of smallest key norm (kvpress' PrefillDecodingPress)."""
    model = tiny_model("llama")
    prompt = random_prompt(1, 50)
    replace_for("llama")(method="snapkv", max_capacity_prompts=24, window_size=4)
    plain = held_positions(output_cache(greedy(model, prompt, new_tokens=1)))
    replace_for("llama")(method="snapkv", max_capacity_prompts=24, window_size=4, decode_method="l2norm",
                         decode_budget=16, decode_interval=4, l2norm_skip_layers=(),
                         l2norm_protect_window=True)
    keys_at = {}

    def record(module, args, kwargs, output):
        layer = kwargs[CACHE_ARGUMENT].layers[module.layer_idx]
        keys, _, columns = layer.kept_tokens(appended=True)
        if module.layer_idx == 1:
            keys_at[layer.tokens_seen] = (keys[0], columns[0], layer.tail_length)

    handle = model.model.layers[1].self_attn.register_forward_hook(record, with_kwargs=True)
    out = greedy(model, prompt, new_tokens=12)
    handle.remove()
    assert keys_at[50][2] == 0 and [sorted(c[c >= 0].tolist()) for c in keys_at[50][1]] == plain[1]
    before = None
    for seen in sorted(keys_at):
        keys, columns, tail = keys_at[seen]
        if tail == 0 and before is not None:  # compressed this step: the oracle ranks what was held before it
            held_keys, held_columns = before  # and the step's new token, at seen - 1 (in the window)
            for head in range(2):
                real = held_columns[head] >= 0
                positions, norms = held_columns[head][real], held_keys[head][real].float().norm(dim=-1)
                newest = positions >= seen - 4
                rest = torch.where(newest, float("inf"), norms).argsort()[: 16 - 4]
                expected = sorted(positions[newest].tolist() + [seen - 1] + positions[rest].tolist())
                assert sorted(columns[head][columns[head] >= 0].tolist()) == expected
        before = (keys, columns)
    assert output_cache(out).layers[1].tokens_seen == 61


def test_scores_taken_as_tokens_come_rank_as_rescoring_the_held_tokens_does(monkeypatch):
    """L2Norm scores each token alone: ranking its stored scores beside the new tokens' (the way of scorers that
    read what a layer does not keep, here forced by declaring it a reader of RoPE tables) keeps what scoring every
    held key again keeps (its own way)."""
    model = tiny_model("llama")
    prompt = random_prompt(1, 50)
    options = dict(method="l2norm", max_capacity_prompts=24, window_size=4, decode_budget=18, decode_interval=3,
                   l2norm_skip_layers=())
    assert not CompressionConfig(**options).scores_on_arrival
    replace_for("llama")(**options)
    rescored = greedy(model, prompt, new_tokens=14)
    monkeypatch.setattr(L2Norm, "needs_rotary", True)
    assert CompressionConfig(**options).scores_on_arrival
    replace_for("llama")(**options)
    stored = greedy(model, prompt, new_tokens=14)
    assert torch.equal(stored.sequences, rescored.sequences)
    assert all(torch.equal(a, b) for a, b in zip(stored.logits, rescored.logits))
    assert held_positions(output_cache(stored)) == held_positions(output_cache(rescored))


def test_a_scorer_of_hidden_states_keeps_the_best_scored_tokens_as_they_came(tmp_path):
    """KVzap while decoding (kvpress' DecodingPress(KVzapPress)): every token is scored once from its own
    attention input; each compression keeps the window and the best-scored held tokens. The oracle replays the
    rule on the surrogate's scores of the inputs the model's attention received."""
    path, tensors = surrogate_file(tmp_path / "kvzap.safetensors", mlp=False)
    model = tiny_model("llama")
    inputs = {}

    def record(module, args, kwargs):
        if module.layer_idx == 2:
            inputs.setdefault("hidden", []).append(kwargs["hidden_states"][0])

    hook = model.model.layers[2].self_attn.register_forward_pre_hook(record, with_kwargs=True)
    budget, window, interval, prompt_budget = 16, 4, 3, 24
    replace_for("llama")(method="kvzap", kvzap_weights=path, max_capacity_prompts=prompt_budget, window_size=window,
                         decode_budget=budget, decode_interval=interval)
    cache = output_cache(greedy(model, random_prompt(1, 50), new_tokens=15))
    hook.remove()
    hidden = torch.cat(inputs["hidden"])  # [64, D]: the prompt's and each decoded token's
    scores = hidden @ tensors["layers.2.weight"].T + tensors["layers.2.bias"]  # [64, H_kv]

    def keep(held, count, seen):
        newest = [p for p in held if p >= seen - window]
        rest = sorted((p for p in held if p < seen - window), key=lambda p: -scores[p, head])
        return set(newest + rest[: count - len(newest)])

    for head in range(2):
        held, tail = keep(range(50), prompt_budget, 50), []
        for position in range(50, 64):
            tail.append(position)
            if len(tail) >= interval:
                held, tail = keep(held | set(tail), budget, position + 1), []
        assert held_positions(cache)[2][head] == sorted(held | set(tail))


def test_future_queries_read_while_decoding_are_the_prompts_formula_on_those_queries():
    """Expected Attention during generation models the queries to come by those it keeps (pre-RoPE, turned by
    the mean rotation after the newest): with no sinks, scoring keys by given queries and their RoPE tables
    (query_rotary) is the prompt's own scoring when the queries are the keys' tokens'."""
    torch.manual_seed(0)
    length, dim = 40, 16
    key, value = torch.randn(1, 2, length, dim), torch.randn(1, 2, length, dim)
    query = torch.randn(1, 4, length, dim)
    angles = torch.arange(length)[:, None] * (1.0 / 100 ** (torch.arange(dim // 2) / (dim // 2)))[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[None], torch.cat([angles.sin()] * 2, -1)[None]
    query = query * cos[:, None] + rotate_half(query) * sin[:, None]
    key = key * cos[:, None] + rotate_half(key) * sin[:, None]
    config = CompressionConfig(method="expected_attention", max_capacity_prompts=20, window_size=4, n_sink=0)
    plan = plan_layer(config, torch.ones(1, length, dtype=torch.bool))
    prompt = config.policy.score(LayerInputs(query, key, value, plan, rotary=(cos, sin)))
    generating = config.policy.score(LayerInputs(query, key, value, plan, query_rotary=(cos, sin)))
    torch.testing.assert_close(generating, prompt)


@pytest.mark.parametrize("method", ["expected_attention", "capkv"])
def test_a_scorer_of_future_queries_compresses_during_generation(method):
    model = tiny_model("llama")
    replace_for("llama")(method=method, max_capacity_prompts=24, window_size=4, decode_budget=16, decode_interval=5)
    cache = output_cache(greedy(model, random_prompt(1, 50), new_tokens=20))
    for layer in cache.layers:
        assert isinstance(layer, CompressedLayer) and layer.tokens_seen == 69
        assert int(layer.held_counts.max()) == 16 + layer.tail_length
        assert layer.recent_queries.shape[2] == 5 and layer.recent_rotary[0].shape[1] == 5


def test_a_whole_prompt_method_decodes_with_the_decode_method():
    """KVzip's reconstruction scores the prompt (after its whole prefill); SnapKV's window compresses generation."""
    model = tiny_model("llama")
    replace_for("llama")(method="kvzip", compression_ratio=0.5, window_size=4, decode_method="snapkv",
                         decode_budget=16, decode_interval=4)
    cache = output_cache(greedy(model, random_prompt(1, 50), new_tokens=15))
    assert all(int(layer.held_counts.max()) <= 16 + 4 for layer in cache.layers)
    assert all(layer.tokens_seen == 64 for layer in cache.layers)


def test_the_uncompressed_prompt_with_a_decode_method_compresses_only_generation():
    model = tiny_model("llama")
    replace_for("llama")(method="fullkv", decode_method="snapkv", window_size=4, decode_budget=20, decode_interval=5)
    cache = output_cache(greedy(model, random_prompt(1, 50), new_tokens=12))
    assert all(int(layer.held_counts.max()) <= 20 + 5 for layer in cache.layers)


@pytest.mark.parametrize("options, fragment", [
    (dict(method="kvzip", decode_budget=64), "--method kvzip scores the prompt by the model repeating it"),
    (dict(method="snapkv", decode_method="kvzip", decode_budget=64), "--decode_method kvzip scores the prompt"),
    (dict(method="laprox", decode_budget=64), "--method laprox ranks tokens across every layer at once"),
    (dict(method="snapkv", decode_budget=64, decode_compression_ratio=0.5), "either --decode_budget or"),
    (dict(method="snapkv", decode_compression_ratio=1.0), "--decode_compression_ratio must lie in \\[0, 1\\)"),
    (dict(method="snapkv", decode_method="nope", decode_budget=64), "--decode_method 'nope' is not a known method"),
    (dict(method="fullkv", decode_budget=64), "--method fullkv evicts nothing \\(--decode_method names"),
    (dict(method="expected_attention", prefill_chunk_size=64), "--method expected_attention models future queries"),
    (dict(method="kvzip", decode_method="kvzap", kvzap_weights=str(SHIPPED_SURROGATES), decode_budget=64),
     "--decode_method kvzap ranks the scores each token got as it came"),
    (dict(method="l2norm", dms=True, dms_threshold=-3.0, dms_decoding=True, decode_budget=64),
     "--dms_decoding evicts by the threshold alone; with --decode_budget"),
    (dict(method="snapkv", dms=True, dms_threshold=0.1, dms_decoding=True),
     "--dms_decoding scores each token once as it comes; --method snapkv"),
    (dict(method="restorekv", decode_method="snapkv", decode_budget=64),
     "--method restorekv keeps its restore tokens as entries of their own"),
    (dict(method="l2norm", dms=True, dms_threshold=-3.0, dms_decoding=True, prefill_chunk_size=32),
     "--dms_decoding ranks the scores each token got as it came; --prefill_chunk_size 32"),
])
def test_what_generation_cannot_compress_is_refused_in_one_line(options, fragment):
    with pytest.raises(ConfigError, match=fragment):
        CompressionConfig(compression_ratio=0.5, window_size=4, **options)


def test_a_decode_method_given_without_compression_during_generation_is_ignored_with_a_warning():
    with pytest.warns(UserWarning, match="--decode_method not used"):
        config = CompressionConfig(method="snapkv", compression_ratio=0.5, decode_method="l2norm")
    assert config.decoding is None and config.run.decode_method is None


def test_the_decode_methods_options_are_the_same_flags():
    config = CompressionConfig(method="kvzip", compression_ratio=0.5, decode_method="snapkv", decode_budget=64,
                               kernel_size=3, window_size=8)
    assert config.decoding.policy.name == "snapkv" and config.decoding.policy.kernel_size == 3
    assert config.decoding.run.window_size == 8 and config.decoding.run.decode_budget == 64


@pytest.mark.parametrize("options", [
    dict(method="snapkv", decode_compression_ratio=0.5, allocation="adakv"),
    dict(method="snapkv", decode_compression_ratio=0.5, residual=True),
    dict(method="kvzip", decode_method="adakv", decode_budget=40),
    dict(method="expected_attention", decode_budget=40, residual=True),
    dict(method="snapkv", decode_method="expected_attention", decode_budget=40, allocation="adakv"),
    dict(method="l2norm", l2norm_skip_layers=(), dms=True, dms_threshold=-2.5, dms_decoding=True, decode_interval=2),
])
def test_compression_during_generation_composes_with_the_other_parts(options):
    assert_model_compresses(dict(dict(max_capacity_prompts=48, window_size=8, decode_interval=4), **options),
                            new_tokens=12)


@pytest.mark.parametrize("options", [
    dict(method="expected_attention", max_capacity_prompts=20, decode_compression_ratio=0.6),
    dict(method="kvzap", max_capacity_prompts=20, decode_budget=16),
    dict(method="l2norm", l2norm_skip_layers=(), l2norm_protect_window=True, max_capacity_prompts=30, dms=True,
         dms_threshold=-2.5, dms_decoding=True),
    dict(method="snapkv", max_capacity_prompts=20, decode_method="l2norm", l2norm_skip_layers=(), decode_budget=16),
    dict(method="snapkv", max_capacity_prompts=20, decode_compression_ratio=0.6),
])
def test_rows_of_a_batch_stay_independent_under_every_kind_of_compression_during_generation(tmp_path, options):
    """A left-padded row compressed during generation (the queries since the last compression, scores taken as
    tokens came, the threshold alone, another method than the prompt's, a budget of its own share of the tokens
    seen) generates as it does alone: a row within its budget at a due step is not left to be compressed at
    another step than alone."""
    path, _ = surrogate_file(tmp_path / "kvzap.safetensors", mlp=False)
    model = tiny_model("llama")
    replace_for("llama")(window_size=4, decode_interval=3, kvzap_weights=path if options["method"] == "kvzap" else None,
                         **options)
    assert_rows_match_single_row_runs(model, [60, 41, 35], new_tokens=10)
