"""ResKV: residual entries, shared softmax, gate, validation proxy."""

import math

import pytest
import torch
from tiny_models import (FAMILY_BACKENDS, assert_rows_match_single_row_runs, decode_in_chunks, greedy, random_prompt,
                         random_qkv, registered_methods, replace_for, rope_tables, tiny_model)

from restkv import CompressionConfig, ConfigError, compress_kv
from restkv.cache import CompressedLayer, cache_nbytes
from restkv.cache.partial import Probe, merge, softmax_partial
from restkv.integrations.transformers.compat import output_cache
from restkv.integrations.transformers.generation import generate_after_context, prefill
from restkv.pipeline.inputs import LayerFacts
from restkv.switches.residual import (ResidualEntries, ResidualReadout, choose_ratios, entries_of, lloyd_kmeans,
                                      split_observations)
from restkv.switches.residual.validation import KeySegments, segment_cuts, unranked_partial

GATE_OFF = ResidualReadout(gate=False)
PAPER = ResidualReadout()
NEW_TOKENS = 4


def qkv(heads=6, length=120, dim=8, **options):
    """:func:`random_qkv` with this file's default shapes."""
    return random_qkv(heads=heads, length=length, dim=dim, **options)


def residual_config(method="snapkv", budget=40, **options):
    if method == "l2norm":
        options = dict(l2norm_skip_layers=(), **options)
    return CompressionConfig(method=method, max_capacity_prompts=budget, window_size=8, residual=True, **options)


def crafted(evicted: str, seed: int = 0, dim: int = 8, length: int = 64):
    """One head whose queries all point along ``u``: 16 tokens with large logits, a window of 8,
    and 40 other tokens that a budget of 24 evicts. ``cluster``: the 40 share one key with a
    logit only a little lower than the kept ones and one value, so together they carry most of
    the attention mass. ``far``: their keys point away from every query and their values are 0."""
    generator = torch.Generator().manual_seed(seed)
    u = torch.zeros(dim)
    u[0] = 1.0
    query = 3.0 * u + 0.05 * torch.randn(1, 1, length, dim, generator=generator)
    key = torch.zeros(1, 1, length, dim)
    value = torch.randn(1, 1, length, dim, generator=generator)
    key[0, 0, 40:56] = 1.5 * u + 0.05 * torch.randn(16, dim, generator=generator)
    key[0, 0, 56:] = 1.2 * u + 0.05 * torch.randn(8, dim, generator=generator)
    if evicted == "cluster":
        key[0, 0, :40] = 1.0 * u + 0.01 * torch.randn(40, dim, generator=generator)
        value[0, 0, :40] = 4.0 * u
    else:
        key[0, 0, :40] = -3.0 * u + 0.05 * torch.randn(40, dim, generator=generator)
        value[0, 0, :40] = 0.0
    return query, key, value


CRAFTED = dict(budget=24, pooling="none")


# ---------------------------------------------------------------- budget 0 = the base method
@pytest.mark.parametrize("method", registered_methods(splittable=True))
@pytest.mark.parametrize("zero", [dict(residual_ratios=(0.0,)),
                                  dict(residual_no_validation=True, residual_fixed_ratio=0.0),
                                  dict(residual_delta=2.0)])
def test_residual_budget_zero_is_bitwise_the_base_method(method, zero):
    query, key, value = qkv()
    o_proj = torch.randn(48, 6 * 8, generator=torch.Generator().manual_seed(3))
    config = residual_config(method, **zero)
    rotary = rope_tables(query)
    ours = compress_kv(query, key, value, config, o_proj_weight=o_proj, rotary=rotary)
    base = compress_kv(query, key, value, config.replace(residual=False), o_proj_weight=o_proj, rotary=rotary)
    assert ours.residual_log_counts is None
    assert torch.equal(ours.keys, base.keys) and torch.equal(ours.values, base.values)
    assert torch.equal(ours.indices, base.indices)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_model_with_residual_budget_zero_generates_bitwise_the_base_logits(backend):
    model = tiny_model("llama", backend)
    prompt = random_prompt(1, 120)
    runs = []
    for options in (dict(), dict(residual=True, residual_ratios=(0.0,))):
        replace_for("llama")(method="snapkv", max_capacity_prompts=40, window_size=8, **options)
        runs.append(model.generate(prompt, max_new_tokens=4, do_sample=False, output_logits=True,
                                   return_dict_in_generate=True))
    assert all(torch.equal(a, b) for a, b in zip(runs[0].logits, runs[1].logits))


# ---------------------------------------------------------------- main cache = base at budget m
@pytest.mark.parametrize("method", registered_methods(uniform=True, splittable=True))
def test_main_cache_is_the_base_method_at_the_smaller_budget(method):
    query, key, value = qkv()
    o_proj = torch.randn(48, 6 * 8, generator=torch.Generator().manual_seed(3))
    config = residual_config(method, residual_no_validation=True, residual_fixed_ratio=0.25)  # r = 10 of 40
    rotary = rope_tables(query)
    ours = compress_kv(query, key, value, config, o_proj_weight=o_proj, rotary=rotary)
    base = compress_kv(query, key, value, config.replace(residual=False, max_capacity_prompts=30), o_proj_weight=o_proj,
                       rotary=rotary)
    assert torch.equal(ours.indices[..., :30], base.indices) and bool((ours.indices[..., 30:] == -1).all())
    assert torch.equal(ours.keys[..., :30, :], base.keys)
    assert bool(torch.isfinite(ours.residual_log_counts).all())
    # Every evicted token is a member of exactly one entry: counts sum to |E| = L - m.
    assert torch.equal(ours.residual_log_counts.exp().sum(dim=-1).round(), torch.full((1, 2), 90.0))


def test_adakv_budgets_are_split_per_head():
    query, key, value = qkv(length=160)
    config = residual_config("adakv", budget=48, residual_no_validation=True, residual_fixed_ratio=0.2)
    ours = compress_kv(query, key, value, config)
    base = compress_kv(query, key, value, config.replace(residual=False))
    budgets = (base.indices >= 0).sum(dim=-1)
    main = (ours.indices >= 0).sum(dim=-1)
    entries = torch.isfinite(ours.residual_log_counts).sum(dim=-1)
    assert not torch.equal(budgets[0, 0], budgets[0, 1])  # the heads really differ
    assert torch.equal(main + entries, budgets)
    expected = torch.tensor([math.floor(0.2 * b) for b in budgets.flatten().tolist()]).view_as(budgets)
    assert torch.equal(entries, expected)
    assert ours.keys.shape == base.keys.shape  # the layer is exactly as wide as the base method's


# ---------------------------------------------------------------- k-means and entries
def kmeans_objective(points, members, clusters):
    centre = clusters.centres.gather(1, clusters.assignment.clamp(min=0)[..., None].expand_as(points))
    return float((((points - centre) ** 2).sum(dim=-1) * members).sum())


def test_kmeans_objective_never_increases_and_is_deterministic():
    generator = torch.Generator().manual_seed(0)
    points = torch.randn(2, 300, 8, generator=generator)
    members = torch.rand(2, 300, generator=generator) < 0.8
    init = torch.stack([torch.nonzero(row)[:12, 0] for row in members])
    objectives = [kmeans_objective(points, members, lloyd_kmeans(points, members, init, steps))
                  for steps in range(1, 5)]
    assert all(later <= earlier + 1e-4 for earlier, later in zip(objectives, objectives[1:]))
    first, again = lloyd_kmeans(points, members, init, 4), lloyd_kmeans(points, members, init, 4)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert bool((first.assignment[~members] == -1).all()) and bool((first.assignment[members] >= 0).all())


def test_kmeans_starts_from_the_given_centres_in_order():
    # Three well separated groups; seeds given in the order 2, 0, 1 keep that slot order.
    centres = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    noise = 0.1 * torch.randn(1, 12, 2, generator=torch.Generator().manual_seed(0))
    points = centres.repeat_interleave(4, dim=0)[None] + noise
    init = torch.tensor([[8, 0, 4]])
    clusters = lloyd_kmeans(points, torch.ones(1, 12, dtype=torch.bool), init, 4)
    assert clusters.assignment[0].tolist() == [1] * 4 + [2] * 4 + [0] * 4
    torch.testing.assert_close(clusters.centres[0], points[0].view(3, 4, 2).mean(dim=1)[[2, 0, 1]])


def test_singleton_entries_are_the_exact_tokens():
    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 20, 8, generator=generator), torch.randn(1, 20, 8, generator=generator)
    members = torch.zeros(1, 20, dtype=torch.bool)
    members[0, 5:] = True
    entries = entries_of(lloyd_kmeans(keys, members, torch.arange(5, 20)[None], 4), values)
    torch.testing.assert_close(entries.keys[0], keys[0, 5:], rtol=0, atol=0)
    torch.testing.assert_close(entries.values[0], values[0, 5:], rtol=0, atol=0)
    assert entries.log_counts.eq(0).all() and entries.first[0].tolist() == list(range(5, 20))


def test_an_identical_key_cluster_is_exact_in_numerator_and_denominator():
    generator = torch.Generator().manual_seed(0)
    shared_key = torch.randn(8, generator=generator)
    keys = shared_key.expand(1, 6, 8).clone()
    values = torch.randn(1, 6, 8, generator=generator)
    entries = entries_of(lloyd_kmeans(keys, torch.ones(1, 6, dtype=torch.bool), torch.tensor([[2]]), 4), values)
    query = torch.randn(3, 8, generator=generator)
    logit = query @ shared_key * 0.5
    mass = torch.exp(logit + entries.log_counts[0, 0])  # e^(a + log c) = sum over members of e^a
    torch.testing.assert_close(mass, torch.exp(query @ keys[0].T * 0.5).sum(dim=-1))
    torch.testing.assert_close(entries.values[0, 0], values[0].mean(dim=0))


def test_an_emptied_cluster_is_dropped_or_reseeded():
    points = torch.tensor([[[0.0], [0.0], [0.1], [5.0], [5.2]]])
    # Seeds 0 and 1 share a key: ties go to the lowest cluster, so cluster 1 empties at once.
    init = torch.tensor([[0, 1, 3]])
    members = torch.ones(1, 5, dtype=torch.bool)
    dropped = lloyd_kmeans(points, members, init, 4)
    assert dropped.counts[0].tolist() == [3, 0, 2]
    reseeded = lloyd_kmeans(points, members, init, 4, empty="reseed")
    assert bool((reseeded.counts[0] > 0).all()) and int(reseeded.counts.sum()) == 5


# ---------------------------------------------------------------- shared softmax, gate, LSE
def hand_case(seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, 2, 3, 4, generator=generator)  # 2 query heads over 1 KV head, 3 queries
    main_k, main_v = torch.randn(1, 1, 5, 4, generator=generator), torch.randn(1, 1, 5, 4, generator=generator)
    res_k, res_v = torch.randn(1, 1, 2, 4, generator=generator), torch.randn(1, 1, 2, 4, generator=generator)
    return query, main_k, main_v, res_k, res_v, torch.log(torch.tensor([3.0, 5.0]))


def read(query, main_k, main_v, res_k, res_v, log_counts, scale, readout=PAPER, main_columns=None):
    """``[B, q, H, d]``: the queries (at columns after the main tokens) read through a compressed
    layer of the main tokens and, with ``res_k``, the residual entries."""
    length = main_k.shape[2]
    columns = torch.arange(length).expand(1, 1, -1) if main_columns is None else main_columns
    summaries = [] if res_k is None else [ResidualEntries(res_k, res_v, log_counts.view(1, 1, -1), readout)]
    layer = CompressedLayer.from_tokens(main_k, main_v, columns, tokens_seen=length, summaries=summaries)
    probe = Probe(query, main_k.shape[1], length, scale)
    return layer.read(probe)


def exact_partial(logits):
    """The exact tokens' partial of ``logits`` (what the gate reads)."""
    return softmax_partial(logits, torch.zeros(*logits.shape[:-2], logits.shape[-1], 1))


def gate_value(readout, logits):
    return torch.exp(readout.log_gate(exact_partial(logits)))


def test_shared_softmax_is_one_softmax_over_main_and_gated_residual_logits():
    query, main_k, main_v, res_k, res_v, log_counts = hand_case()
    scale, readout = 0.5, ResidualReadout(beta=1.5)
    out = read(query, main_k, main_v, res_k, res_v, log_counts, scale, readout)
    main_logits = query @ main_k.transpose(-1, -2) * scale
    p_max = torch.softmax(main_logits, dim=-1).amax(dim=-1, keepdim=True)
    gate = torch.sigmoid(12.0 * (0.25 - p_max))
    residual_logits = query @ res_k.transpose(-1, -2) * scale + 1.5 * log_counts + torch.log(gate)
    weights = torch.softmax(torch.cat([main_logits, residual_logits], dim=-1), dim=-1)
    expected = weights @ torch.cat([main_v, res_v], dim=2)
    torch.testing.assert_close(out.transpose(1, 2), expected)


def test_no_residual_mass_leaves_the_main_partial_and_the_separate_ablation_differs():
    query, main_k, main_v, res_k, res_v, log_counts = hand_case()
    scale = 0.5
    shared = read(query, main_k, main_v, res_k, res_v, log_counts, scale)
    main_logits = query @ main_k.transpose(-1, -2) * scale
    main_only = torch.softmax(main_logits, dim=-1) @ main_v
    # No residual mass (g = 0, or no entries): the main partial alone, whatever the entries hold.
    closed = read(query, main_k, main_v, res_k * float("nan"), res_v, log_counts.fill_(float("-inf")), scale)
    torch.testing.assert_close(closed.transpose(1, 2), main_only)
    log_counts = torch.log(torch.tensor([3.0, 5.0]))
    separate = ResidualReadout(separate_softmax=True)
    apart = read(query, main_k, main_v, res_k, res_v, log_counts, scale, separate)
    assert not torch.allclose(apart, shared, atol=1e-3)
    omega = gate_value(PAPER, main_logits)[..., None] * 8.0 / (8.0 + 5.0)  # n_E = 3 + 5 members, |M| = 5
    res_only = torch.softmax(query @ res_k.transpose(-1, -2) * scale + log_counts, dim=-1) @ res_v
    torch.testing.assert_close(apart.transpose(1, 2), (1 - omega) * main_only + omega * res_only)


@pytest.mark.parametrize("readout", [PAPER, GATE_OFF, ResidualReadout(beta=0.5, gate_min=0.2),
                                     ResidualReadout(separate_softmax=True), ResidualReadout(alpha=1e6)])
def test_the_read_out_of_validation_equals_that_of_decode(readout):
    """The validation proxy joins entries to a main partial merged from key segments
    (``KeySegments``); decode reads them through the layer: the same read-out."""
    query, main_k, main_v, res_k, res_v, log_counts = hand_case()
    columns = torch.tensor([[[0, 1, -1, 3, 4]]])  # one exact slot is unused
    decoded = read(query, main_k, main_v, res_k, res_v, log_counts, 0.5, readout, columns).transpose(1, 2)[0]
    stacked = query[0].reshape(1, -1, 4)  # [H_kv, G * q, d]
    visible = (columns[0] >= 0)[:, None, :]
    segments = KeySegments.of(stacked, main_k[0], main_v[0], 0.5, None, visible, [0, 2, 5])
    main = segments.joined()
    logits = stacked @ res_k[0].transpose(-1, -2) * 0.5
    validated = readout.join(main, main, logits, res_v[0], log_counts.view(1, 1, -1)).output
    torch.testing.assert_close(validated.view(2, 3, 4), decoded)


def test_gate_values():
    one_hot = torch.tensor([[0.0, -1e4, -1e4, -1e4]])
    torch.testing.assert_close(gate_value(PAPER, one_hot), torch.tensor([1 / (1 + math.exp(9))]))
    assert abs(float(gate_value(PAPER, one_hot)) - 1.2339e-4) < 1e-7
    for m in (4, 32, 4096):
        expected = max(0.0, 1 / (1 + math.exp(-12 * (0.25 - 1 / m))))
        torch.testing.assert_close(gate_value(PAPER, torch.zeros(1, m)), torch.tensor([expected]))
    assert abs(float(gate_value(PAPER, torch.zeros(1, 100000))) - 0.9526) < 1e-4
    assert float(gate_value(ResidualReadout(gate_min=0.01), one_hot)) == pytest.approx(0.01)
    no_gate = residual_config(residual_no_gate=True).switch("residual").readout()
    assert torch.equal(gate_value(no_gate, one_hot), torch.ones(1))


def test_a_closed_gate_gives_the_main_cache_alone_and_each_query_has_its_own_gate():
    query, main_k, main_v, res_k, res_v, log_counts = hand_case()
    closed = ResidualReadout(alpha=1e6)  # p_max > tau for every query here, so g = 0
    out = read(query, main_k, main_v, res_k, res_v, log_counts, 0.5, closed)
    main_only = read(query, main_k, main_v, None, None, None, 0.5)
    torch.testing.assert_close(out, main_only)
    gates = gate_value(PAPER, query @ main_k.transpose(-1, -2) * 0.5)
    assert len(set(gates.flatten().tolist())) == gates.numel()


# ---------------------------------------------------------------- exactness through the model
def singleton_cache(model, input_ids, main_positions, readout):
    """Prefill natively, then store every layer as ``main_positions`` exact + every other token as
    its own residual entry (k-means with r = |E|)."""
    cache = prefill(model, input_ids)
    length = input_ids.shape[1]
    main = torch.tensor(main_positions)
    evicted = torch.tensor([p for p in range(length) if p not in main_positions])
    for index, layer in enumerate(cache.layers):
        keys, values = layer.keys[0], layer.values[0]
        heads = keys.shape[0]
        members = torch.zeros(heads, length, dtype=torch.bool)
        members[:, evicted] = True
        entries = entries_of(lloyd_kmeans(keys, members, evicted.expand(heads, -1), 4), values)
        sliding = getattr(layer, "sliding_window", None)
        summary = ResidualEntries(entries.keys[None].to(keys.dtype), entries.values[None].to(values.dtype),
                                  entries.log_counts[None], readout, None if sliding is None else entries.first[None])
        cache.layers[index] = CompressedLayer.from_tokens(keys[:, main][None], values[:, main][None],
                                                          main.expand(1, heads, -1), length, sliding, [summary])
    return cache


@pytest.mark.parametrize("family, backend", [("llama", "eager"), ("qwen2", "sdpa"), ("gemma2", "eager")])
def test_every_evicted_token_as_its_own_entry_decodes_like_the_full_cache(family, backend):
    model = tiny_model(family, backend)
    prompt = random_prompt(1, 40)
    main_positions = [0, 1, 2] + list(range(32, 40))
    native = prefill(model, prompt)
    exact = singleton_cache(model, prompt, main_positions, GATE_OFF)
    gated = singleton_cache(model, prompt, main_positions, PAPER)
    replace_for(family)(method="snapkv", max_capacity_prompts=20, window_size=8, residual=True)
    mask = torch.ones(1, 40, dtype=torch.long)
    step = torch.tensor([[7, 9, 11]])  # a question chunk, then single tokens
    references = decode_in_chunks(model, native, mask, step)
    ours = decode_in_chunks(model, exact, mask, step)
    papers = decode_in_chunks(model, gated, mask, step)
    for reference, our, paper in zip(references, ours, papers, strict=True):
        torch.testing.assert_close(our, reference, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(paper, reference, rtol=1e-4, atol=1e-4)  # g <= 0.9526: not exact


# ---------------------------------------------------------------- validation proxy
def test_validation_keeps_the_pure_main_cache_when_residuals_cannot_help():
    query, key, value = crafted("far")
    out = compress_kv(query, key, value, residual_config(**CRAFTED))
    assert out.residual_log_counts is None
    base = compress_kv(query, key, value, residual_config(**CRAFTED).replace(residual=False))
    assert torch.equal(out.indices, base.indices)


def test_validation_picks_a_positive_ratio_for_a_heavy_evicted_cluster():
    query, key, value = crafted("cluster")
    out = compress_kv(query, key, value, residual_config(**CRAFTED))
    entries = torch.isfinite(out.residual_log_counts).sum()
    assert int(entries) >= 1 and int((out.indices >= 0).sum()) + int(entries) == 24
    # The entries hold (nearly) the whole cluster, with its value.
    assert float(out.residual_log_counts.exp().nansum()) >= 40
    assert torch.isclose(out.values[0, 0, -1, 0], torch.tensor(4.0), atol=0.5)


@pytest.mark.parametrize("options", [dict(residual_val_causal=True), dict(residual_val_split="last"),
                                     dict(residual_val_split="random:3"), dict(residual_select_on="validation"),
                                     dict(residual_no_gate=True), dict(residual_separate_softmax=True),
                                     dict(residual_val_gate=False), dict(residual_empty="reseed")])
def test_every_validation_variant_still_finds_the_heavy_cluster(options):
    query, key, value = crafted("cluster")
    out = compress_kv(query, key, value, residual_config(**CRAFTED, **options))
    assert out.residual_log_counts is not None and bool(torch.isfinite(out.residual_log_counts).any())


@pytest.mark.parametrize("causal", [False, True])
def test_the_validation_target_read_in_two_parts_is_the_full_prompt_attention(causal):
    """The proxy's target reads the ranked prefix as segments and the rest (keys only the target reads) with the
    fused kernel; merged, they are one float32 softmax over every key, also for queries that see none of the rest."""
    generator = torch.Generator().manual_seed(5)
    queries, keys, values = (torch.randn(2, shape, 8, generator=generator) for shape in (6, 40, 40))
    visible = None
    if causal:  # query i sees the keys ranked up to 30 + i: the first two see nothing past the prefix of 32
        visible = (torch.arange(40)[None, :] <= torch.arange(30, 36)[:, None])[None].expand(2, -1, -1)
    whole = KeySegments.of(queries, keys, values, 0.3, None, visible, segment_cuts(40, [])).joined().output
    prefix = KeySegments.of(queries, keys[:, :32], values[:, :32], 0.3, None,
                            None if visible is None else visible[..., :32], segment_cuts(32, [20])).joined()
    rest = unranked_partial(queries, keys[:, 32:], values[:, 32:], 0.3, None,
                            None if visible is None else visible[..., 32:])
    torch.testing.assert_close(merge([prefix, rest], statistics=False).output, whole, rtol=1e-5, atol=1e-6)


def test_ratio_decision_rule():
    # Candidates are ratios (0, r1, r2); column 0 is the pure main cache.
    fit = torch.tensor([[1.0, 0.8, 0.7], [1.0, 0.8, 0.7], [1.0, 1.2, 1.3], [1.0, 0.7, 0.7]])
    val = torch.tensor([[1.0, 0.9, 0.995], [1.0, 0.9, 0.9901], [1.0, 0.5, 0.5], [1.0, 0.6, 0.6]])
    chosen = choose_ratios(fit, val, val[:, 0], delta=0.01)
    # head 0: fit picks r2, which improves validation by 0.5% < delta; head 1: by 0.99%, just below;
    # head 2: fit prefers the main cache; head 3: a fit tie goes to the smaller ratio.
    assert chosen.tolist() == [-1, -1, -1, 1]
    assert choose_ratios(fit, val, val[:, 0], delta=0.0098).tolist() == [-1, 2, -1, 1]
    assert choose_ratios(fit, val, val[:, 0], delta=0.01, select_on="validation").tolist() == [1, 1, 1, 1]
    assert choose_ratios(fit[:1], torch.zeros(1, 3), torch.zeros(1), delta=0.01).tolist() == [-1]


def test_observation_split():
    interleaved = split_observations(128, 32, 128, "interleave")
    assert torch.nonzero(interleaved)[:, 0].tolist() == list(range(3, 128, 4))
    assert torch.nonzero(split_observations(128, 32, 128, "last"))[:, 0].tolist() == list(range(96, 128))
    drawn = split_observations(128, 32, 128, "random:7")
    assert int(drawn.sum()) == 32 and torch.equal(drawn, split_observations(128, 32, 128, "random:7"))
    assert int(split_observations(40, 32, 128, "interleave").sum()) == 10  # scaled to a shorter row
    assert split_observations(1, 32, 128, "interleave").tolist() == [False]


# ---------------------------------------------------------------- storage, batches, determinism
@pytest.mark.parametrize("family, backend", [("llama", "sdpa"), ("qwen2", "eager")])
def test_stored_entries_equal_the_budget_and_bytes_stay_within_two_percent(family, backend):
    model = tiny_model(family, backend)
    prompt = random_prompt(1, 200)
    replace_for(family)(method="snapkv", max_capacity_prompts=50, window_size=8)
    base = prefill(model, prompt)
    for options in (dict(residual_no_validation=True), dict(residual_ratios=(0.0, 0.1, 0.2), residual_delta=0.0)):
        replace_for(family)(method="snapkv", max_capacity_prompts=50, window_size=8, residual=True, **options)
        cache = prefill(model, prompt)
        assert any(layer.summaries for layer in cache.layers)
        for layer in cache.layers:
            assert torch.equal(layer.kept_counts + layer.summary_counts, torch.full((1, 2), 50))
            # GQA: one slot array per KV head, never repeated
            assert layer.kept_keys.shape[1] == 2 and all(s.keys.shape[1] == 2 for s in layer.summaries)
        assert cache_nbytes(cache) <= 1.02 * cache_nbytes(base)


def test_left_padded_rows_equal_their_single_row_runs_and_runs_repeat_bit_for_bit():
    lengths = [120, 64, 90]
    query, key, value = qkv(batch=3)
    crafted_query, crafted_key, crafted_value = crafted("cluster", dim=8, length=64)
    query[1, :, -64:] = crafted_query[0].repeat(6, 1, 1)  # row 1 keeps residual entries
    key[1, :, -64:], value[1, :, -64:] = crafted_key[0].repeat(2, 1, 1), crafted_value[0].repeat(2, 1, 1)
    mask = torch.zeros(3, 120, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, 120 - length :] = 1
    config = residual_config(budget=24, pooling="none")
    batched = compress_kv(query, key, value, config, attention_mask=mask)
    again = compress_kv(query, key, value, config, attention_mask=mask)
    tensors = [name for name in vars(batched) if name != "state"]
    assert all(getattr(batched, name) is None if getattr(again, name) is None
               else torch.equal(getattr(batched, name), getattr(again, name)) for name in tensors)
    assert bool(torch.isfinite(batched.residual_log_counts[1]).any())
    for row, length in enumerate(lengths):
        part = slice(120 - length, 120)
        alone = compress_kv(query[row : row + 1, :, part], key[row : row + 1, :, part],
                            value[row : row + 1, :, part], config)
        assert torch.equal(batched.indices[row], alone.indices[0])
        assert torch.equal(batched.keys[row], alone.keys[0]) and torch.equal(batched.values[row], alone.values[0])
        if alone.residual_log_counts is None:
            assert not bool(torch.isfinite(batched.residual_log_counts[row]).any())
        else:
            width = alone.residual_log_counts.shape[-1]
            assert torch.equal(batched.residual_log_counts[row, :, -width:], alone.residual_log_counts[0])
            assert torch.equal(batched.residual_positions[row, :, -width:], alone.residual_positions[0])


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_model_batch_rows_equal_single_rows_with_residual_entries(backend):
    model = tiny_model("llama", backend)
    replace_for("llama")(method="snapkv", max_capacity_prompts=24, window_size=8, residual=True,
                         residual_no_validation=True, residual_fixed_ratio=0.2)
    batched = assert_rows_match_single_row_runs(model, [90, 64, 41], new_tokens=NEW_TOKENS)
    assert output_cache(batched).layers[0].summary_counts.tolist() == [[4, 4]] * 3


def test_beam_search_reorders_residual_entries_with_their_rows():
    model = tiny_model("llama")
    replace_for("llama")(method="snapkv", max_capacity_prompts=30, window_size=8, residual=True,
                         residual_no_validation=True)
    prompt = random_prompt(1, 90)
    beams = model.generate(prompt, max_new_tokens=3, num_beams=2, do_sample=False, return_dict_in_generate=True,
                           pad_token_id=0)
    layer = output_cache(beams).layers[0]
    assert layer.summaries[0].log_counts.shape[0] == 2 and layer.summary_counts.tolist() == [[3, 3]] * 2
    cache = prefill(model, prompt)
    cache.batch_repeat_interleave(3)
    assert all(layer.summaries[0].log_counts.shape[0] == 3 and layer.kept_keys.shape[0] == 3
               for layer in cache.layers)


# ---------------------------------------------------------------- every family, both settings
@pytest.mark.parametrize("family, backend", FAMILY_BACKENDS)
def test_query_aware_and_query_agnostic_generation_with_residual_entries(family, backend):
    model = tiny_model(family, backend)
    options = dict(method="snapkv", max_capacity_prompts=30, window_size=8)
    replace_for(family)(**options, residual=True, residual_no_validation=True, residual_fixed_ratio=0.2)
    prompt = random_prompt(1, 100)
    aware = greedy(model, prompt, new_tokens=NEW_TOKENS)
    cache = output_cache(aware)
    assert all(layer.summary_counts.tolist() == [[6, 6]] for layer in cache.layers)
    new, agnostic_cache = generate_after_context(model, prompt[:, :80], prompt[:, 80:], max_new_tokens=3,
                                                 do_sample=False, pad_token_id=0, return_cache=True)
    assert new.shape == (1, 3)
    for layer in agnostic_cache.layers:  # compressed once, from the context alone: 80 - 24 evicted tokens
        torch.testing.assert_close(layer.summaries[0].log_counts.exp().sum(dim=-1), torch.full((1, 2), 56.0))
    # The residual entries change the decode steps' logits relative to the base method (the first
    # step's logits come from the uncompressed prefill).
    replace_for(family)(**options)
    base = greedy(model, prompt, new_tokens=NEW_TOKENS)
    assert torch.equal(aware.logits[0], base.logits[0]) and not torch.allclose(aware.logits[1], base.logits[1])


def test_separate_softmax_and_no_gate_ablations_change_the_model_output():
    model = tiny_model("llama")
    prompt = random_prompt(1, 100)
    logits = {}
    for name, extra in (("paper", {}), ("no_gate", dict(residual_no_gate=True)),
                        ("separate", dict(residual_separate_softmax=True))):
        replace_for("llama")(method="snapkv", max_capacity_prompts=30, window_size=8, residual=True,
                             residual_no_validation=True, **extra)
        # logits[1]: the first step read from the compressed cache
        logits[name] = greedy(model, prompt, new_tokens=NEW_TOKENS).logits[1]
    assert not torch.allclose(logits["paper"], logits["no_gate"])
    assert not torch.allclose(logits["paper"], logits["separate"])


def test_on_sliding_window_layers_an_entry_expires_with_its_oldest_member():
    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 1, 3, 4, generator=generator), torch.randn(1, 1, 3, 4, generator=generator)
    columns = torch.tensor([[[8, 9]]])  # two exact tokens, and one entry whose oldest member is column 5

    def layer():
        entry = ResidualEntries(keys[:, :, 2:], values[:, :, 2:], torch.tensor([[[math.log(3.0)]]]), GATE_OFF,
                                torch.tensor([[[5]]]))
        return CompressedLayer.from_tokens(keys[:, :, :2].clone(), values[:, :, :2].clone(), columns, tokens_seen=10,
                                           sliding_window=8, summaries=[entry])

    params = LayerFacts(scaling=0.5, softcap=None, sliding_window=8)
    query = torch.randn(1, 1, 1, 4, generator=generator)
    new_key, new_value = torch.randn(1, 1, 1, 4, generator=generator), torch.randn(1, 1, 1, 4, generator=generator)

    def attend(seen):
        cache_layer = layer()
        cache_layer.tokens_seen = seen
        return cache_layer.attend(query, new_key, new_value, None, params.scaling, params.softcap)[0, 0, 0]

    q = query[0, 0, 0]
    exact_logits = torch.cat([keys[0, 0, :2] @ q, new_key[0, 0] @ q]) * 0.5
    exact_values = torch.cat([values[0, 0, :2], new_value[0, 0]])
    entry_logit = (keys[0, 0, 2] @ q) * 0.5 + math.log(3.0)
    # A query at column 10 sees keys > 2: the entry (oldest member at column 5) is visible.
    weights = torch.softmax(torch.cat([exact_logits, entry_logit[None]]), dim=-1)
    torch.testing.assert_close(attend(10), weights @ torch.cat([exact_values, values[0, 0, 2:]]))
    # A query at column 13 sees keys > 5 only: the entry has expired, the exact tokens remain.
    torch.testing.assert_close(attend(13), torch.softmax(exact_logits, dim=-1) @ exact_values)


def test_sliding_window_layers_compress_with_residual_entries_in_a_model():
    model = tiny_model("gemma3", "sdpa", sliding_window=32)
    replace_for("gemma3")(method="snapkv", max_capacity_prompts=16, window_size=4, residual=True,
                          residual_no_validation=True, residual_fixed_ratio=0.25)
    out = greedy(model, random_prompt(1, 80), new_tokens=NEW_TOKENS)
    cache = output_cache(out)
    sliding = [layer for layer in cache.layers if layer.sliding_window is not None]
    assert sliding and all(layer.summaries[0].oldest is not None for layer in sliding)
    assert all(layer.summary_counts.tolist() == [[4, 4]] for layer in cache.layers)
    assert all(torch.isfinite(step).all() for step in out.logits)


# ---------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    "options, flag",
    [
        (dict(residual_ratios=(0.1, 1.0)), "--residual_ratios"),
        (dict(residual_fixed_ratio=-0.1), "--residual_fixed_ratio"),
        (dict(residual_obs_queries=1), "--residual_obs_queries"),
        (dict(residual_val_queries=128), "--residual_val_queries"),
        (dict(residual_val_split="every_other"), "--residual_val_split"),
        (dict(residual_iters=0), "--residual_iters"),
        (dict(residual_beta=-1.0), "--residual_beta"),
        (dict(residual_delta=float("nan")), "--residual_delta"),
        (dict(residual_gate_alpha=0.0), "--residual_gate_alpha"),
        (dict(residual_gate_min=1.5), "--residual_gate_min"),
        (dict(residual_select_on="both"), "--residual_select_on"),
        (dict(residual_empty="keep"), "--residual_empty"),
        (dict(residual_no_gate="yes"), "--residual_no_gate"),
        (dict(residual=True, merge="pivot"), "--merge pivot"),
        (dict(residual=True, method="cam"), "--method cam"),
        (dict(residual=True, method="streamingllm"), "--method streamingllm"),
    ],
)
def test_bad_residual_options_name_the_flag(options, flag):
    settings = dict(method="snapkv", max_capacity_prompts=64, window_size=8)
    settings.update(options)
    with pytest.raises(ConfigError, match=flag):
        CompressionConfig(**settings)


def test_residual_defaults_are_the_papers_and_every_flag_reaches_the_runners():
    config = CompressionConfig(max_capacity_prompts=64, residual=True)
    assert config.residual_ratios == (0.0, 0.05, 0.1, 0.15, 0.2)
    assert (config.residual_obs_queries, config.residual_val_queries, config.residual_iters) == (128, 32, 4)
    assert (config.residual_beta, config.residual_delta, config.residual_fixed_ratio) == (1.0, 0.01, 0.1)
    assert (config.residual_gate_tau, config.residual_gate_alpha, config.residual_gate_min) == (0.25, 12.0, 0.0)
    import argparse

    from restkv.benchmarks.flags import add_compression_flags

    parser = argparse.ArgumentParser()
    add_compression_flags(parser)
    args = parser.parse_args(["--residual", "--residual_ratios", "0", "0.1", "--residual_no_gate",
                              "--residual_separate_softmax", "--residual_no_validation", "--residual_gate_tau", "0.3"])
    assert args.residual and args.residual_no_gate and args.residual_separate_softmax and args.residual_no_validation
    parsed = CompressionConfig(max_capacity_prompts=64, residual_ratios=args.residual_ratios)
    assert parsed.residual_ratios == (0.0, 0.1)
