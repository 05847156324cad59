"""IndexMem: the indexer's oracle, the memory's read-out, budgets, batches, weights files, training."""

import math
import warnings

import pytest
import torch
from tiny_models import (assert_patch_reproduces_unpatched, assert_rows_match_single_row_runs, greedy, random_prompt,
                         random_qkv, replace_for, tiny_model)
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import restkv.policies.indexmem as indexmem_policy
import restkv.tools.train_indexmem as train_indexmem
from restkv import CompressionConfig, ConfigError, compress_kv
from restkv.cache import CompressedLayer, cache_report
from restkv.cache.partial import use_kernel
from restkv.cache.segments.memory import slots_for
from restkv.integrations.transformers.capture import attention_inputs
from restkv.integrations.transformers.compat import output_cache
from restkv.learned.indexmem import Architecture, IndexMemLayer, IndexMemWeights, load_weights
from restkv.pipeline.compress import compress_layer
from restkv.pipeline.inputs import LayerInputs
from restkv.pipeline.plan import plan_layer, valid_from_mask
from restkv.scoring.rope import unrotate
from restkv.tools.train_indexmem import build_parser, capture_layers, read_attention, read_distances, train

pytestmark = pytest.mark.filterwarnings("ignore:restkv. --method indexmem without")

#: the tiny models' shapes (tests/tiny_models.py COMMON): 3 layers, 4 heads, 2 KV heads, head dim 16
TINY = dict(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16)
#: a memory of post-RoPE keys and queries, the ones the compression pipeline and the cache pass today
POST_ROPE = dict(memory_inputs="post_rope")


def qkv(length=120, **options):
    return random_qkv(heads=6, kv_heads=2, length=length, dim=8, **options)


def config(budget=40, **options):
    return CompressionConfig(method="indexmem", max_capacity_prompts=budget, window_size=8, **options)


def saved(tmp_path, arch: Architecture, edit=None, name="weights.pt") -> str:
    """A weights file of freshly initialised layers, each changed by ``edit(layer)``."""
    layers = [IndexMemLayer(arch, index) for index in range(arch.num_layers)]
    with torch.no_grad():
        for layer in layers:
            if edit is not None:
                edit(layer)
    path = tmp_path / name
    IndexMemWeights(arch, layers, {"note": "test"}).save(path)
    return str(path)


def snapkv_oracle(scaling):
    """An indexer with identity maps, no normalisation and the attention scale as temperature:
    its softmax is the model's window attention, SnapKV's score."""
    def edit(layer):
        layer.log_temperature.fill_(math.log(scaling))
    return edit


# ---------------------------------------------------------------- the indexer's oracle
@pytest.mark.parametrize("pooling", ["none", "avgpool", "maxpool"])
def test_an_indexer_that_reproduces_snapkv_scores_selects_what_snapkv_selects(tmp_path, pooling):
    query, key, value = qkv()
    arch = Architecture(1, 6, 2, 8, features=4, normalize=False)
    path = saved(tmp_path, arch, snapkv_oracle(1 / math.sqrt(8)))
    ours = compress_kv(query, key, value, config(indexmem_weights=path, indexmem_features=4, indexmem_memory=False,
                                                 pooling=pooling))
    snap = compress_kv(query, key, value, CompressionConfig(method="snapkv", max_capacity_prompts=40, window_size=8,
                                                            pooling=pooling))
    assert torch.equal(ours.indices, snap.indices)


def test_the_fallback_indexer_is_snapkv_and_the_memory_takes_its_slots_from_the_budget():
    query, key, value = qkv()
    snap = lambda budget: compress_kv(query, key, value, CompressionConfig(  # noqa: E731
        method="snapkv", max_capacity_prompts=budget, window_size=8))
    alone = compress_kv(query, key, value, config(indexmem_memory=False))
    assert torch.equal(alone.indices, snap(40).indices) and torch.equal(alone.keys, snap(40).keys)
    slots = slots_for(4, 8, 2 * 8 * 4)  # 4 features x 9 numbers x 4 bytes over 64-byte slots: 3
    assert slots == 3
    ours = compress_kv(query, key, value, config(indexmem_features=4))
    assert torch.equal(ours.indices, snap(40 - slots).indices)


def test_the_learned_indexer_trains_its_temperature_and_maps():
    layer = IndexMemLayer(Architecture(1, 6, 2, 8, features=4))
    query, key, _ = qkv()
    scores = layer.importance(query, key, torch.ones(1, 120, dtype=torch.bool), 8)
    scores.sum().backward()
    assert scores.shape == (1, 6, 120)
    assert all(p.grad is not None for p in (layer.index_query, layer.index_key, layer.log_temperature))


def test_the_dsa_form_scores_every_visible_key_and_none_of_the_padding():
    layer = IndexMemLayer(Architecture(1, 6, 2, 8, features=4, indexer_form="dsa", indexer_heads=3))
    query, key, _ = qkv()
    valid = torch.ones(1, 120, dtype=torch.bool)
    valid[0, :20] = False
    scores = layer.importance(query, key, valid, 8)
    assert bool((scores[..., :20] == 0).all()) and bool((scores[..., 20:] > 0).all())
    torch.testing.assert_close(scores.sum(dim=-1), torch.ones(1, 6))


# ---------------------------------------------------------------- the memory
def hand_layer():
    """One KV head, head dim 2, two features with omega = identity rows; no decay, unit rate."""
    layer = IndexMemLayer(Architecture(1, 1, 1, 2, features=2))
    with torch.no_grad():
        layer.feature_omega.copy_(torch.eye(2)[None])
        layer.decay_logit.fill_(float("inf"))
    return layer


def test_memory_readout_by_hand():
    layer = hand_layer()
    scaling = 1.0
    keys = torch.tensor([[[[1.0, 0.0], [0.0, 2.0], [5.0, 5.0]]]])
    values = torch.tensor([[[[1.0, 3.0], [-2.0, 4.0], [9.0, 9.0]]]])
    evicted = torch.tensor([[[True, True, False]]])
    state = layer.write(keys, values, evicted, torch.zeros(3), scaling)

    def phi(x):  # exp(omega x - |x|^2 / 2) / sqrt(F), omega = I
        return torch.exp(x - x.square().sum() / 2) / math.sqrt(2)

    query = torch.tensor([0.5, -1.0])
    weights = [phi(query) @ phi(keys[0, 0, i]) for i in range(2)]
    expected = (weights[0] * values[0, 0, 0] + weights[1] * values[0, 0, 1]) / (weights[0] + weights[1])
    readout, log_mass = layer.read(state, query.view(1, 1, 1, 2), scaling)
    torch.testing.assert_close(readout.view(2), expected)
    torch.testing.assert_close(log_mass.view(()), torch.log(weights[0] + weights[1]))
    # The shared softmax: (N_M + Z_E m) / (Z_M + Z_E) for an exact branch with output o and mass Z_M.
    output, lse = torch.tensor([[[[0.25, -0.5]]]]), torch.tensor([[[0.3]]])
    fused = layer.fuse(output, lse, readout, log_mass, query.view(1, 1, 1, 2), "shared_softmax")
    z_main, z_memory = math.exp(0.3), float(weights[0] + weights[1])
    torch.testing.assert_close(fused.view(2), (z_main * output.view(2) + z_memory * expected) / (z_main + z_memory))


def test_decay_and_rate_weight_the_writes():
    layer = hand_layer()
    with torch.no_grad():
        layer.decay_logit.fill_(0.0)  # lambda = 1/2 per token of age
        layer.log_rate.fill_(math.log(3.0))
    keys = torch.zeros(1, 1, 2, 2)
    values = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
    state = layer.write(keys, values, torch.ones(1, 1, 2, dtype=torch.bool), torch.tensor([1.0, 0.0]), 1.0)
    # phi(0) = 1/sqrt(2) per feature; weights 3 * 1/2 and 3 * 1: the older token counts half as much.
    torch.testing.assert_close(state.feature_values[0, 0, 0], torch.tensor([1 / 3, 2 / 3]))
    torch.testing.assert_close(state.log_mass[0, 0], torch.full((2,), math.log(4.5 / math.sqrt(2))))


def test_random_features_converge_to_the_exact_evicted_contribution():
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 1, 64, 8, generator=generator) * 0.7
    values = torch.randn(1, 1, 64, 8, generator=generator)
    query = torch.randn(1, 1, 1, 8, generator=generator) * 0.7
    scaling = 1 / math.sqrt(8)
    logits = (query @ keys.transpose(-1, -2)) * scaling
    exact = torch.softmax(logits, dim=-1) @ values
    errors = []
    for features in (16, 65536):
        layer = IndexMemLayer.fallback(Architecture(1, 1, 1, 8, features=features), 0, seed=1)
        state = layer.write(keys, values, torch.ones(1, 1, 64, dtype=torch.bool), torch.zeros(64), scaling)
        readout, log_mass = layer.read(state, query, scaling)
        errors.append(float((readout - exact).norm() / exact.norm()))
    assert errors[1] < 0.05 and errors[1] < errors[0]
    assert abs(float(log_mass) - float(torch.logsumexp(logits, dim=-1))) < 0.05  # the evicted mass too


def test_no_evicted_tokens_leave_the_output_bitwise_unchanged():
    layer = hand_layer()
    state = layer.write(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2), torch.zeros(1, 1, 3, dtype=torch.bool),
                        torch.zeros(3), 1.0)
    output = torch.randn(1, 1, 4, 2)
    for fusion in ("residual", "shared_softmax"):
        readout, log_mass = layer.read(state, torch.randn(1, 1, 4, 2), 1.0)
        assert torch.equal(layer.fuse(output, torch.zeros(1, 1, 4), readout, log_mass, torch.randn(1, 1, 4, 2),
                                      fusion), output)


def compressed_layer(query, key, value, options) -> CompressedLayer:
    cfg = config(**options)
    plan = plan_layer(cfg, valid_from_mask(None, 1, key.shape[2], key.device))
    state = compress_layer(cfg, LayerInputs(query, key, value, plan))
    return CompressedLayer.from_state(state, key.shape[2], None, cfg)


def test_a_zero_gate_is_plain_eviction_bit_for_bit(tmp_path):
    query, key, value = qkv()
    path = saved(tmp_path, Architecture(1, 6, 2, 8, features=4, **POST_ROPE),
                 lambda layer: layer.gate_bias.fill_(float("-inf")))
    options = dict(indexmem_weights=path, indexmem_features=4)
    gated = compressed_layer(query, key, value, options)
    plain = compressed_layer(query, key, value, options)
    assert gated.corrections
    plain.corrections = []
    step = torch.randn(1, 6, 2, 8), torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8)
    with use_kernel("reference"):  # the same kernel for both (the fused one needs no log-sum-exp without a memory)
        assert torch.equal(gated.attend(*step, None, 1 / math.sqrt(8)), plain.attend(*step, None, 1 / math.sqrt(8)))
        # A gate that is open changes the output.
        with torch.no_grad():
            gated.corrections[0].layer.gate_bias.fill_(0.0)
        assert not torch.equal(gated.attend(*step, None, 1 / math.sqrt(8)),
                               plain.attend(*step, None, 1 / math.sqrt(8)))


def test_the_fallback_memory_moves_decode_towards_full_attention():
    """Shared-softmax fallback with many features: closer to full attention than eviction alone."""
    query, key, value = qkv(length=400, seed=3)
    key = key * 0.3  # a flat attention: much mass on the evicted tokens
    options = dict(budget=300, indexmem_features=256, indexmem_fusion="shared_softmax")  # 144 slots of memory
    ours = compressed_layer(query, key, value, options)
    plain = compressed_layer(query, key, value, options)
    plain.corrections = []
    new_query, new_key, new_value = torch.randn(1, 6, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    every_key = torch.cat([key, new_key], 2).repeat_interleave(3, dim=1)
    every_value = torch.cat([value, new_value], 2).repeat_interleave(3, dim=1)
    weights = torch.softmax(new_query @ every_key.transpose(-1, -2) / math.sqrt(8), dim=-1)
    full = (weights @ every_value).transpose(1, 2)
    errors = [float((layer.attend(new_query, new_key, new_value, None, 1 / math.sqrt(8)) - full).norm())
              for layer in (ours, plain)]
    assert errors[0] < 0.7 * errors[1]


def open_gate(layer):
    layer.gate_weight.normal_(generator=torch.Generator().manual_seed(10))
    layer.gate_bias.fill_(0.0)


def memory_read_at(path, offset, pre_rope=True):
    """The decode output of a layer (weights at ``path``) whose memory was written and read with
    the prompt and the reading query rotated by a tiny Llama's RoPE at positions shifted by ``offset``."""
    cfg = config(indexmem_weights=path, indexmem_features=4)
    query, key, value = random_qkv(length=120, seed=7)
    new_query = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(8))
    cos, sin = tiny_model("llama").model.rotary_emb(key, torch.arange(121)[None] + offset)
    prompt, step = (cos[:, :120], sin[:, :120]), (cos[:, 120:], sin[:, 120:])
    rotated_query, rotated_key = apply_rotary_pos_emb(query, key, *prompt)
    rotated_step = apply_rotary_pos_emb(new_query, new_query, *step)[0]
    plan = plan_layer(cfg, valid_from_mask(None, 1, 120, key.device))
    ctx = LayerInputs(rotated_query, rotated_key, value, plan, rotary=prompt if pre_rope else None)
    columns = torch.arange(80, 120).expand(1, 2, -1)  # the newest 40 kept, 80 evicted into the memory
    state = cfg.policy.summarise(ctx, columns, None)[0]
    output, lse = torch.randn(1, 1, 4, 16, generator=torch.Generator().manual_seed(9)), torch.zeros(1, 4, 1)
    return state.correct(rotated_step, output, lse, pre_rope_query=unrotate(rotated_step, *step) if pre_rope else None)


def test_a_pre_rope_memory_and_its_gate_carry_no_position(tmp_path):
    """The paper's memory carries no position: written from the keys before RoPE and read
    (features and gate) with the query before RoPE, the memory's correction is the same wherever
    the prompt sits; a post-RoPE memory's is not."""
    pre, post = (saved(tmp_path, Architecture(1, 4, 2, 16, features=4, memory_inputs=inputs), open_gate,
                       name=f"{inputs}.pt") for inputs in ("pre_rope", "post_rope"))
    near, far = (memory_read_at(pre, offset) for offset in (0, 300))
    torch.testing.assert_close(near, far, rtol=1e-4, atol=1e-5)
    post_near, post_far = (memory_read_at(post, offset, pre_rope=False) for offset in (0, 300))
    assert not torch.allclose(post_near, post_far, atol=1e-3)
    assert not torch.allclose(near, post_near, atol=1e-3)
    with pytest.raises(ConfigError, match="--indexmem_weights: this memory reads pre-RoPE keys"):
        memory_read_at(pre, 0, pre_rope=False)
    query, key, value = random_qkv(length=120)
    state = compressed_layer(query, key, value, dict(indexmem_weights=post, indexmem_features=4)).corrections[0]
    state.layer = IndexMemLayer(Architecture(1, 4, 2, 16, features=4))  # a pre-RoPE memory's read
    with pytest.raises(ConfigError, match="this memory reads pre-RoPE queries"):
        state.correct(torch.randn(1, 4, 1, 16), torch.randn(1, 1, 4, 16), torch.zeros(1, 4, 1))


def test_earlier_weights_files_hold_post_rope_memories(tmp_path):
    path = saved(tmp_path, Architecture(**TINY, features=4))
    payload = torch.load(path, weights_only=True)
    payload["format"] = "restkv-indexmem-v1"
    del payload["architecture"]["memory_inputs"]
    torch.save(payload, path)
    assert load_weights(path).arch.memory_inputs == "post_rope"
    payload["format"], payload["architecture"]["memory_inputs"] = "restkv-indexmem-v2", "sideways"
    torch.save(payload, path)
    with pytest.raises(ConfigError, match="--indexmem_weights .*damaged IndexMem weights .*memory_inputs 'sideways'"):
        load_weights(path)


# ---------------------------------------------------------------- on a model
def test_budget_at_or_above_the_prompt_reproduces_the_unpatched_model():
    model = tiny_model("llama", "eager")
    prompt = random_prompt(1, 60)
    assert_patch_reproduces_unpatched(model, "llama", prompt, method="indexmem", max_capacity_prompts=60,
                                      window_size=8, indexmem_features=4)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("weights", [False, True])
def test_each_row_of_a_left_padded_batch_equals_its_single_row_run(tmp_path, backend, weights):
    model = tiny_model("llama", backend)
    options = dict(method="indexmem", max_capacity_prompts=24, window_size=8, indexmem_features=4)
    if weights:
        arch = Architecture(**TINY, features=4, **POST_ROPE)
        options["indexmem_weights"] = saved(tmp_path, arch, lambda layer: layer.gate_bias.fill_(0.0))
    replace_for("llama")(**options)
    batched = assert_rows_match_single_row_runs(model, [90, 64, 41])
    layer = output_cache(batched).layers[0]
    slots = slots_for(4, 16, 2 * 16 * 4)
    assert layer.kept_counts.tolist() == [[24 - slots] * 2] * 3
    assert bool(torch.isfinite(layer.corrections[0].log_mass).any(dim=-1).all())


def test_rows_within_the_budget_keep_every_token_and_write_no_memory():
    model = tiny_model("llama", "eager")
    replace_for("llama")(method="indexmem", max_capacity_prompts=50, window_size=8, indexmem_features=4)
    ids = torch.zeros(2, 90, dtype=torch.long)
    mask = torch.zeros(2, 90, dtype=torch.long)
    ids[0], mask[0] = random_prompt(1, 90)[0], 1
    ids[1, -30:], mask[1, -30:] = random_prompt(1, 30, seed=4)[0], 1
    layer = output_cache(greedy(model, ids, mask, new_tokens=2)).layers[1]
    assert layer.kept_counts[1].tolist() == [30, 30] and layer.kept_counts[0].tolist() == [50 - 3] * 2
    assert bool(torch.isneginf(layer.corrections[0].log_mass[1]).all())
    assert bool(torch.isfinite(layer.corrections[0].log_mass[0]).all())


def test_runs_are_deterministic(tmp_path):
    model = tiny_model("llama", "eager")
    replace_for("llama")(method="indexmem", max_capacity_prompts=24, window_size=8, indexmem_features=4)
    runs = [greedy(model, random_prompt(1, 80)) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(runs[0].logits, runs[1].logits))
    for first, second in zip(output_cache(runs[0]).layers, output_cache(runs[1]).layers):
        assert torch.equal(first.kept_keys, second.kept_keys)
        assert all(torch.equal(a, b) for a, b in zip(first.corrections[0].tensors(), second.corrections[0].tensors()))


def test_budget_accounting_and_bytes_against_snapkv():
    model = tiny_model("llama", "eager")
    prompt = random_prompt(1, 120)
    held = {}
    for method, extra in (("snapkv", {}), ("indexmem", dict(indexmem_features=15))):
        replace_for("llama")(method=method, max_capacity_prompts=40, window_size=8, **extra)
        cache = output_cache(greedy(model, prompt, new_tokens=1))
        held[method] = (cache_report(cache), cache)
    slots = slots_for(15, 16, 2 * 16 * 4)  # 15 x 17 x 4 = 1020 bytes: 8 slots of 128
    assert slots == 8
    for report, layer in zip(held["indexmem"][0], held["indexmem"][1].layers):
        assert report.summary_slots == slots
        assert layer.kept_counts.tolist() == [[40 - slots] * 2]
        assert report.stored_max + report.summary_slots <= 40 + 1  # + the generated token's tail entry
    ours = sum(r.used_nbytes for r in held["indexmem"][0])  # what the budget holds, the spare room aside
    snap = sum(r.used_nbytes for r in held["snapkv"][0])
    assert 0.98 * snap <= ours <= 1.02 * snap


@pytest.mark.parametrize("allocation", ["pyramid", "adakv"])
def test_under_an_allocation_every_head_gives_the_memory_its_slots(allocation):
    query, key, value = qkv()
    for layer in range(3):
        counts = {}
        for method in ("snapkv", "indexmem"):
            extra = dict(indexmem_features=1) if method == "indexmem" else {}  # 1 x 9 x 4 bytes: 1 slot
            options = dict(method=method, allocation=allocation, max_capacity_prompts=40, window_size=8, **extra)
            out = compress_kv(query, key, value, CompressionConfig(**options), layer_idx=layer, num_layers=3)
            counts[method] = (out.indices >= 0).sum(dim=-1)
        assert torch.equal(counts["indexmem"], counts["snapkv"] - 1)  # the fallback scores as SnapKV does


def test_a_budget_the_memory_leaves_no_room_in_is_an_error():
    query, key, value = qkv()
    with pytest.raises(ConfigError, match="--indexmem_features"):
        compress_kv(query, key, value, config(budget=12, indexmem_features=8))


# ---------------------------------------------------------------- options and files
@pytest.mark.parametrize("options, flag", [
    (dict(residual=True), "--residual"),
    (dict(moments=True), "--moments"),  # once accepted: it reserved the statistics' slots and built nothing
    (dict(prefill_chunk_size=64), "--prefill_chunk_size"),
    (dict(indexmem_fusion="residual"), "--indexmem_weights"),
])
def test_unsupported_combinations_are_errors(options, flag):
    with pytest.raises(ConfigError, match=flag):
        config(**options)


def test_weights_round_trip(tmp_path):
    arch = Architecture(**TINY, features=6, indexer_form="dsa", indexer_heads=2)
    path = saved(tmp_path, arch, lambda layer: layer.gate_weight.normal_())
    loaded = load_weights(path)
    assert loaded.arch == arch and loaded.training == {"note": "test"}
    again = tmp_path / "again.pt"
    loaded.save(again)
    for first, second in zip(loaded.layers, load_weights(again).layers):
        assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))


def test_bad_weights_files_name_the_flag(tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    other = tmp_path / "other.pt"
    torch.save({"format": "something-else"}, other)
    for path in (tmp_path / "missing.pt", garbage, other):
        with pytest.raises(ConfigError, match="--indexmem_weights"):
            config(indexmem_weights=str(path))
    path = saved(tmp_path, Architecture(**TINY, features=4))
    with pytest.raises(ConfigError, match="--indexmem_features 32 differs"):
        config(indexmem_weights=path)
    query, key, value = qkv()  # 6 heads of dim 8: not the file's model
    with pytest.raises(ConfigError, match="was trained for"):
        compress_kv(query, key, value, config(indexmem_weights=path, indexmem_features=4))


def test_the_fallback_says_so_once(monkeypatch):
    monkeypatch.setattr(indexmem_policy, "_FALLBACK_WARNED", False)
    query, key, value = qkv()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compress_kv(query, key, value, config(indexmem_features=4))
        compress_kv(query, key, value, config(indexmem_features=4))
    assert sum("training-free fallback" in str(w.message) for w in caught) == 1


def training_args(*extra):
    return build_parser().parse_args(["--window_size", "8", "--future", "16", "--read_distance", "48", "--blocks",
                                      "2", "--steps_per_sequence", "4", "--indexmem_features", "4", "--kept_fraction",
                                      "0.3", "--lr", "1e-2", *extra])


def test_a_short_training_run_on_a_tiny_model(tmp_path):
    model = tiny_model("llama", "eager").requires_grad_(False)
    sequences = [random_prompt(1, 96, seed=seed) for seed in (5, 6)]
    weights = train(model, sequences, training_args())
    assert weights.training["steps"] == 8 and weights.training["tokens"] == 192
    assert weights.arch.memory_inputs == weights.training["memory_inputs"] == "pre_rope"
    first, last = weights.training["first_losses"], weights.training["last_losses"]
    assert all(math.isfinite(value) for value in (*first, *last))
    fresh = IndexMemLayer(weights.arch, 0)
    assert not torch.equal(weights.layers[0].index_key, fresh.index_key)
    assert not torch.equal(weights.layers[0].gate_bias, fresh.gate_bias)
    path = tmp_path / "tiny.pt"
    weights.save(path)
    assert load_weights(path).arch.memory_inputs == "pre_rope"
    options = dict(method="indexmem", max_capacity_prompts=24, window_size=8, indexmem_features=4)
    replace_for("llama")(**options, indexmem_weights=str(path))
    out = greedy(model, random_prompt(1, 80))  # the pipeline hands the memory its keys and queries before RoPE
    assert all(bool(torch.isfinite(step).all()) for step in out.logits)
    assert output_cache(out).layers[0].corrections[0].layer.arch.memory_inputs == "pre_rope"
    post = train(model, sequences, training_args("--memory_inputs", "post_rope"))
    post.save(path)
    replace_for("llama")(**options, indexmem_weights=str(path))
    out = greedy(model, random_prompt(1, 80))
    assert all(bool(torch.isfinite(step).all()) for step in out.logits)
    assert output_cache(out).layers[0].corrections[0].fusion == "residual"


# ---------------------------------------------------------------- the training command
TRAIN_TINY = ["--num_sequences", "1", "--seq_len", "96", "--window_size", "8", "--future", "16", "--read_distance",
              "32", "--blocks", "1", "--steps_per_sequence", "1", "--indexmem_features", "4"]


def test_the_training_command_writes_weights_the_method_loads(tiny_model_dir, tmp_path):
    out = tmp_path / "new_folder" / "weights.pt"  # a folder it makes
    weights = train_indexmem.main(["--model_path", str(tiny_model_dir), "--output", str(out), *TRAIN_TINY])
    assert load_weights(out).arch == weights.arch and weights.training["steps"] == 1


@pytest.mark.parametrize("flags, message", [
    # the weights were lost: a path found unwritable only when they were saved, after the training (R2)
    (["--output", "{tmp}"], "--output {tmp}: a folder; give a file path"),
    (["--output", "{tmp}/a_file/w.pt"], "--output {tmp}/a_file/w.pt: cannot make its folder: {tmp}/a_file is a file"),
    (["--lr", "-1"], "--lr must be > 0; got -1.0"),
    (["--model_path", "{tmp}/no-model"], "--model_path {tmp}/no-model: no such folder; give a local model folder, a "
                                         "hub id (org/name) or an embedded model (smollm2-135m, gemma3-270m)"),
])
def test_the_training_command_checks_its_flags_before_the_model_loads(flags, message, tmp_path, refuse_model_loading):
    refuse_model_loading(train_indexmem, "load_frozen")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as stop:
        train_indexmem.main([*TRAIN_TINY, *(flag.format(tmp=tmp_path) for flag in flags)])
    assert stop.value.code == f"error: {message.format(tmp=tmp_path)}"


@pytest.mark.parametrize("family, message", [
    ("gpt2", "model type 'gpt2' is not supported by restkv: GPT2Attention needs an attention that"),  # AttributeError
    ("cohere2", "no pre-RoPE queries and keys: cohere2 layer 0 rotates them in a way restkv does not undo"),
])
def test_a_model_whose_queries_restkv_cannot_read_is_one_error_line(family, message, tiny_folder_of, tmp_path):
    with pytest.raises(SystemExit) as stop:
        train_indexmem.main(["--model_path", str(tiny_folder_of(family)), "--output", str(tmp_path / "w.pt"),
                             *TRAIN_TINY])
    assert str(stop.value.code).startswith("error: ") and message in stop.value.code and "\n" not in stop.value.code
    assert not (tmp_path / "w.pt").exists()


def test_a_hub_id_that_cannot_be_reached_is_one_line_naming_the_embedded_models():
    """It was a 93-line OSError traceback offline."""
    with pytest.raises(SystemExit) as stop:
        train_indexmem.main(["--model_path", "org/no-such-model", *TRAIN_TINY])
    message = stop.value.code
    assert message.startswith("error: --model_path org/no-such-model: cannot load it (") and "\n" not in message
    assert message.endswith("or an embedded model (smollm2-135m, gemma3-270m)")


def test_training_captures_the_queries_and_keys_before_rope():
    """The same projections with cos 1 and sin 0 (no rotation) are the pre-RoPE ones."""
    model = tiny_model("llama", "eager")
    ids = random_prompt(1, 20)
    expected = {}

    def unrotated(module, args, kwargs):
        cos, _ = kwargs["position_embeddings"]
        no_rotation = (torch.ones_like(cos), torch.zeros_like(cos))
        expected[module.layer_idx] = attention_inputs(module, kwargs["hidden_states"], no_rotation)

    hooks = [block.self_attn.register_forward_pre_hook(unrotated, with_kwargs=True) for block in model.model.layers]
    captured = capture_layers(model, ids)
    for hook in hooks:
        hook.remove()
    for index, layer in enumerate(captured):
        query, key, value = expected[index]
        torch.testing.assert_close(layer.pre_rope_query, query, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.pre_rope_key, key, rtol=1e-5, atol=1e-5)
        assert torch.equal(layer.value, value) and not torch.allclose(layer.key, key, atol=1e-3)
        assert layer.memory_inputs("pre_rope")[1] is layer.pre_rope_key
        assert layer.memory_inputs("post_rope")[1] is layer.key


def test_the_memory_is_read_at_the_distances_decoding_reads_it():
    """Reading queries spread over --read_distance tokens after the block (not only the next
    --future), each reading the kept tokens and every token up to itself."""
    args = training_args()
    generator = torch.Generator().manual_seed(0)
    draws = [read_distances(args, generator) for _ in range(20)]
    assert all(len(set(d.tolist())) == 16 and int(d.min()) >= 0 and int(d.max()) < 48 for d in draws)
    assert max(int(d.max()) for d in draws) >= 40 and any(int(d.max()) >= 16 for d in draws)
    query, key, value = qkv(length=120)
    columns = torch.tensor([[[0, 3, 10, 20, 39], [1, 2, 5, 30, 38]]])  # kept of [0, 40)
    distances = torch.tensor([0, 7, 33])
    main, lse, full = read_attention(query, key, value, columns, 40, distances, 0.3)
    for row, distance in enumerate(distances.tolist()):
        position = 40 + distance
        for head in range(6):
            kv = head // 3
            seen = torch.cat([columns[0, kv], torch.arange(40, position + 1)])
            logits = query[0, head, position] @ key[0, kv, seen].T * 0.3
            torch.testing.assert_close(main[0, head, row], torch.softmax(logits, -1) @ value[0, kv, seen])
            torch.testing.assert_close(lse[0, head, row], torch.logsumexp(logits, -1))
            logits = query[0, head, position] @ key[0, kv, : position + 1].T * 0.3
            torch.testing.assert_close(full[0, head, row], torch.softmax(logits, -1) @ value[0, kv, : position + 1])
