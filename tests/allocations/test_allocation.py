"""Budget allocations (uniform, pyramid, AdaKV, HeadKV): their formulas as oracles, the
PyramidKV golden fixtures, composition with every scorer, ragged
storage, exactness and batch invariance."""

import json

import pytest
import torch
from golden import kept_sets, load_case, reference_kept_sets
from tiny_models import (FAMILY_BACKENDS, assert_patch_reproduces_unpatched, assert_refused_when_configured,
                         assert_rows_match_single_row_runs, greedy, left_padded, random_prompt, random_qkv,
                         registered_methods, replace_for, rope_tables, tiny_model)

from restkv import CompressionConfig, ConfigError, compress_kv
from restkv.allocations.adakv import adakv_caps
from restkv.allocations.headkv import headkv_table
from restkv.allocations.pyramid import pyramid_schedule
from restkv.cache import cache_report
from restkv.files.head_scores import load_head_scores, save_head_scores


def write_head_scores(path, per_head):
    """A score file from a ``[layers, heads]`` nested list of per-head probe lists."""
    save_head_scores(path, {f"{l}-{h}": values for l, row in enumerate(per_head) for h, values in enumerate(row)})
    return str(path)


def random_head_scores(path, layers, heads, seed=0):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(layers, heads, 3, generator=generator) ** 3  # skewed, as real head scores are
    return write_head_scores(path, scores.tolist())


def write_curve(path, curve):
    """A LU-KV budget curve file: ``[99, layers, KV heads]`` prune ratios."""
    import numpy as np

    np.save(path, np.asarray(curve))
    return str(path)


@pytest.fixture(scope="module")
def tiny_lukv_curve(tmp_path_factory):
    """A curve for the tiny test models (3 layers x 2 KV heads) that prunes half of every head."""
    return write_curve(tmp_path_factory.mktemp("lukv") / "tiny.npy", torch.full((99, 3, 2), 0.5))


@pytest.fixture(scope="module")
def tiny_head_scores(tmp_path_factory):
    """Scores for the tiny test models (3 layers x 4 query heads)."""
    return random_head_scores(tmp_path_factory.mktemp("heads") / "tiny.json", 3, 4)


def stored_counts(out):
    return (out.indices >= 0).sum(dim=-1)


def kept(out, row=0, head=0):
    return [i for i in out.indices[row, head].tolist() if i >= 0]


# ---------------------------------------------------------------- PyramidKV
def test_pyramid_reference_rounding_gives_the_hand_schedule():
    """C = 128, W = 32, N = 32, long prompt: B = 96, n_min = 4, n_max = 188, step 5."""
    schedule = pyramid_schedule(128, 32, 10_000, 32, beta=20, reference_rounding=True)
    assert schedule == tuple(188 - 5 * layer for layer in range(32))
    assert schedule[-1] == 33 and sum(schedule) > 32 * 96  # the release overshoots the total


@pytest.mark.parametrize("num_layers", [2, 8, 30, 32])
@pytest.mark.parametrize("beta", [1, 5, 20])
def test_pyramid_exact_schedule_sums_to_the_uniform_total_and_never_increases(num_layers, beta):
    for budget, window, length in [(128, 32, 10_000), (64, 8, 300), (1024, 32, 4000), (200, 32, 420), (40, 0, 90)]:
        schedule = pyramid_schedule(budget, window, length, num_layers, beta=beta)
        assert sum(schedule) == num_layers * (budget - window)
        assert all(a >= b for a, b in zip(schedule, schedule[1:]))
        assert max(schedule) <= length - window and min(schedule) >= 0


def test_pyramid_clamps_the_first_layer_to_the_prompt():
    """C = 128, W = 32, L = 200: n_max = 188 >= L - W = 168, so n_max = 168 and n_min = 192 - 168."""
    reference = pyramid_schedule(128, 32, 200, 8, reference_rounding=True)
    assert reference == tuple(168 - 20 * layer for layer in range(8))  # step floor(144 / 7) = 20
    exact = pyramid_schedule(128, 32, 200, 8)
    assert exact[0] == 168 and exact[-1] == 24 and sum(exact) == 8 * 96


def test_pyramid_middle_regime_is_uniform_unless_use_pyramid():
    """C <= L < 2B keeps SnapKV's uniform B in PyramidKV; the ReST-KV release has no middle regime."""
    assert pyramid_schedule(128, 32, 150, 8) == (96,) * 8
    no_middle = pyramid_schedule(128, 32, 150, 8, middle_regime=False)
    assert no_middle[0] == 150 - 32 and no_middle != (96,) * 8 and sum(no_middle) == 8 * 96


def test_pyramid_single_layer_keeps_the_uniform_budget():
    assert pyramid_schedule(128, 32, 1000, 1) == (96,)
    assert pyramid_schedule(128, 32, 1000, 1, reference_rounding=True) == (96,)


@pytest.mark.parametrize("name, layer, stored", [("pyramidkv_l0", 0, 220), ("pyramidkv_l7", 7, 38)])
def test_golden_pyramidkv_with_reference_rounding(name, layer, stored):
    """Same kept set per head as the original release (CPU, float32, batch 1, MHA)."""
    case = load_case(name)
    options = case["options"]
    config = dict(
        method="pyramidkv", max_capacity_prompts=options["max_capacity_prompt"], window_size=options["window_size"],
        kernel_size=options["kernel_size"], pooling=options["pooling"], pyramid_beta=options["beta"],
        pyramid_reference_rounding=True,
    )
    out = compress_kv(case["query"], case["key"], case["value"], config, layer_idx=layer,
                      num_layers=options["num_hidden_layers"])
    assert out.keys.shape == case["key_out"].shape == (1, 4, stored, 32)
    assert kept_sets(out.indices) == reference_kept_sets(case)


def test_golden_pyramidkv_default_rounding_differs_only_in_the_layer_budget():
    """The library's exact rounding (a deliberate fix: the release's floored step overshoots the
    total) gives layer 7 of 8 four candidates instead of six; the same scores choose them, so
    they are the release's top four of six."""
    case = load_case("pyramidkv_l7")
    config = dict(method="pyramidkv", max_capacity_prompts=128, window_size=32)
    out = compress_kv(case["query"], case["key"], case["value"], config, layer_idx=7, num_layers=8)
    assert stored_counts(out).tolist() == [[36] * 4]
    for ours, theirs in zip(kept_sets(out.indices), reference_kept_sets(case)):
        assert ours < theirs


def test_pyramid_layers_store_the_schedule_and_sum_to_the_uniform_total():
    query, key, value = random_qkv(length=300)
    config = dict(method="pyramidkv", max_capacity_prompts=64, window_size=16)
    totals = []
    for layer in range(6):
        out = compress_kv(query, key, value, config, layer_idx=layer, num_layers=6)
        counts = stored_counts(out)
        assert counts.tolist() == [[pyramid_schedule(64, 16, 300, 6)[layer] + 16] * 2]
        assert kept(out)[-16:] == list(range(284, 300))
        totals.append(int(counts.sum()))
    assert sum(totals) == 6 * 2 * 64


def test_use_pyramid_gives_any_scorer_the_schedule_without_the_middle_regime():
    query, key, value = random_qkv(length=70)  # C = 48, W = 8: B = 40, C <= L = 70 < 2B
    uniform = compress_kv(query, key, value, dict(method="snapkv", max_capacity_prompts=48, window_size=8,
                                                  allocation="pyramid"), layer_idx=0, num_layers=4)
    release = compress_kv(query, key, value, dict(method="snapkv", max_capacity_prompts=48, window_size=8,
                                                  use_pyramid=True), layer_idx=0, num_layers=4)
    assert stored_counts(uniform).tolist() == [[48, 48]]
    assert stored_counts(release).tolist() == [[8 + 62] * 2]  # n_max = L - W


# ---------------------------------------------------------------- AdaKV
@pytest.mark.parametrize("heads", [1, 2, 3, 8])
@pytest.mark.parametrize("floor", [0.0, 0.2, 0.5, 1.0])
@pytest.mark.parametrize("normalize", [True, False])
def test_adakv_exact_caps_sum_to_the_layer_budget_and_respect_the_floor(heads, floor, normalize):
    generator = torch.Generator().manual_seed(heads)
    for budget, available in [(10, 40), (96, 300), (7, 8)]:
        scores = torch.rand(heads, available, generator=generator) ** 4 * torch.rand(heads, 1, generator=generator)
        caps = adakv_caps(scores, budget, floor, normalize=normalize)
        assert int(caps.sum()) == heads * budget
        assert bool((caps >= int(floor * budget)).all()) and bool((caps <= available).all())


def test_adakv_is_uniform_with_floor_one_or_identical_heads():
    scores = torch.rand(4, 50, generator=torch.Generator().manual_seed(3))
    assert adakv_caps(scores, 12, 1.0).tolist() == [12] * 4
    assert adakv_caps(scores[:1].expand(4, -1), 12, 0.2).tolist() == [12] * 4


def test_adakv_gives_sharp_heads_more_than_flat_ones():
    sharp = torch.zeros(50)
    sharp[:20] = 1.0
    flat = torch.full((50,), 0.02)
    caps = adakv_caps(torch.stack([sharp, flat]), 10, 0.2, normalize=False)
    assert caps.tolist() == [18, 2]  # floor 2 each, the remaining 16 all go to the sharp head


def test_adakv_normalisation_weights_each_head_by_its_top_share():
    """Head 0 is flat (its top-1 holds 1/4 of its mass), head 1 concentrated (2.9/3):
    unnormalised, head 0's raw scores win both slots; normalised, each head gets one."""
    scores = torch.tensor([[3.0, 3.0, 3.0, 3.0], [2.9, 0.1, 0.0, 0.0]])
    assert adakv_caps(scores, 1, 0.0, normalize=False).tolist() == [2, 0]
    assert adakv_caps(scores, 1, 0.0, normalize=True).tolist() == [1, 1]


def test_adakv_reference_allocation_follows_the_original_rounding():
    """cap_k = round((1 - a) n_k + floor(a B)) after a global top-H B over the normalised sorted
    scores; B = 96, a = 0.2, H = 8."""
    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(8, 400, generator=generator) ** torch.linspace(1, 8, 8)[:, None]
    ranked = scores.sort(dim=-1, descending=True).values
    ranked = ranked * ranked[:, :96].sum(-1, keepdim=True) / ranked.sum(-1, keepdim=True)
    winners = ranked.flatten().topk(8 * 96).indices // 400
    won = torch.bincount(winners, minlength=8)
    expected = [round(0.8 * n + 19) for n in won.tolist()]  # Python's round: half to even, like torch
    caps = adakv_caps(scores, 96, 0.2, reference=True)
    assert caps.tolist() == expected
    assert int(adakv_caps(scores, 96, 0.2).sum()) == 768  # the exact default on the same scores


def test_adakv_through_compress_kv_keeps_ragged_counts_with_the_window():
    query, key, value = random_qkv(heads=8, kv_heads=4, length=200, seed=5)
    out = compress_kv(query, key, value, dict(method="adakv", max_capacity_prompts=40, window_size=8))
    counts = stored_counts(out)[0]
    assert int(counts.sum()) == 4 * 40 and len(set(counts.tolist())) > 1
    assert bool((counts - 8 >= int(0.2 * 32)).all())
    assert out.keys.shape[2] == int(counts.max())
    for head in range(4):
        positions = kept(out, head=head)
        assert positions == sorted(positions) and positions[-8:] == list(range(192, 200))


def test_snapkv_with_adakv_allocation_equals_the_adakv_method():
    """AdaKV's window mean and SnapKV's window sum rank identically, within and across heads."""
    query, key, value = random_qkv(heads=8, kv_heads=4, length=150, seed=2)
    method = compress_kv(query, key, value, dict(method="adakv", max_capacity_prompts=40, window_size=8))
    composed = compress_kv(query, key, value, dict(method="snapkv", allocation="adakv", max_capacity_prompts=40,
                                                   window_size=8))
    assert torch.equal(method.indices, composed.indices)


def test_adakv_with_floor_one_equals_snapkv():
    query, key, value = random_qkv(length=150, seed=4)
    adakv = compress_kv(query, key, value, dict(method="adakv", max_capacity_prompts=40, floor=1.0))
    snapkv = compress_kv(query, key, value, dict(method="snapkv", max_capacity_prompts=40))
    assert torch.equal(adakv.indices, snapkv.indices)


# ---------------------------------------------------------------- HeadKV
def test_head_score_file_parses_in_layer_major_order(tmp_path):
    path = write_head_scores(tmp_path / "s.json", [[[10 * l + h, 10 * l + h + 2] for h in range(3)] for l in range(2)])
    text = open(path).read()
    assert text.count("\n") == 1 and list(json.loads(text))[:4] == ["0-0", "0-1", "0-2", "1-0"]
    means = load_head_scores(path, 2, 3)
    assert means.tolist() == [[1.0, 2.0, 3.0], [11.0, 12.0, 13.0]]


def test_head_score_file_errors_name_the_file_and_the_mismatch(tmp_path):
    path = write_head_scores(tmp_path / "s.json", [[[1.0]] * 3] * 2)
    with pytest.raises(ValueError, match=r"s\.json.*6 heads.*2 layers x 4 query heads = 8"):
        load_head_scores(path, 2, 4)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"0-0": []}))
    with pytest.raises(ValueError, match="non-empty list"):
        load_head_scores(bad, 1, 1)
    zero = write_head_scores(tmp_path / "zero.json", [[[0.0]]])
    with pytest.raises(ValueError, match="not all zero"):
        load_head_scores(zero, 1, 1)


def table(path, budget, available, layers, heads, kv_heads, beta=1.01, temperature=1.0):
    return torch.tensor(headkv_table(str(path), 0.0, budget, available, layers, heads, kv_heads, beta, temperature))


def test_headkv_uniform_scores_give_every_head_the_uniform_budget(tmp_path):
    path = write_head_scores(tmp_path / "u.json", [[[0.5, 1.5]] * 4] * 3)
    assert table(path, 20, 100, 3, 4, 2).tolist() == [[20, 20]] * 3


def test_headkv_capacities_follow_the_formula(tmp_path):
    """B = 20, beta = 1.01: floor(B/beta) = 19 pooled per head, base 1; pool = 19 * N * H_kv = 76.
    Importance (normalised) 0.5, 0.25, 0.25, 0 gives 38 + 1, 19 + 1, 19 + 1, 0 + 1."""
    path = write_head_scores(tmp_path / "f.json", [[[2.0], [1.0]], [[1.0], [0.0]]])
    assert table(path, 20, 100, 2, 2, 2).tolist() == [[39, 20], [20, 1]]
    # GQA: query-head importances add up per group (heads 0,1 -> KV head 0; 2,3 -> KV head 1).
    gqa = write_head_scores(tmp_path / "g.json", [[[1.0], [1.0], [1.0], [0.0]], [[1.0], [0.0], [0.0], [0.0]]])
    assert table(gqa, 20, 100, 2, 4, 2).tolist() == [[39, 20], [20, 1]]


def test_headkv_clamps_to_the_prompt_and_spreads_the_excess(tmp_path):
    """Head (0, 0) would get 39 of 30 candidates: it keeps 30 and the other heads share the 9
    in proportion to their scores (4.5 each); the tie in rounding goes to the lower index."""
    path = write_head_scores(tmp_path / "c.json", [[[2.0], [1.0]], [[1.0], [0.0]]])
    capped = table(path, 20, 30, 2, 2, 2)
    assert capped.tolist() == [[30, 25], [24, 1]] and int(capped.sum()) == 80


def test_headkv_temperature_sharpens_the_importance(tmp_path):
    path = write_head_scores(tmp_path / "t.json", [[[2.0], [1.0]], [[1.0], [0.0]]])
    # T = 2: importance 4/6, 1/6, 1/6, 0 -> 76 * (2/3) + 1 = 51.67, 13.67, 13.67, 1 -> total 80.
    assert table(path, 20, 100, 2, 2, 2, temperature=2.0).tolist() == [[52, 14], [13, 1]]


def test_headkv_model_total_is_exact_and_computed_once(tmp_path):
    path = random_head_scores(tmp_path / "r.json", 6, 4)
    query, key, value = random_qkv(heads=4, kv_heads=2, length=200, seed=7)
    config = dict(method="headkv", head_scores=path, max_capacity_prompts=40, window_size=8)
    misses = headkv_table.cache_info().misses
    per_layer = []
    for layer in range(6):
        out = compress_kv(query, key, value, config, layer_idx=layer, num_layers=6)
        counts = stored_counts(out)[0]
        assert kept(out, head=1)[-8:] == list(range(192, 200))
        per_layer.append(int((counts - 8).sum()))
    assert headkv_table.cache_info().misses == misses + 1
    assert sum(per_layer) == 6 * 2 * 32 and len(set(per_layer)) > 1


def test_headkv_window_outside_keeps_the_window_on_top_of_capacities_from_c(tmp_path):
    path = random_head_scores(tmp_path / "o.json", 4, 4)
    query, key, value = random_qkv(heads=4, kv_heads=2, length=300, seed=1)
    config = dict(method="headkv", head_scores=path, max_capacity_prompts=40, window_size=8, headkv_window_outside=True)
    total = sum(int((stored_counts(compress_kv(query, key, value, config, layer_idx=l, num_layers=4)) - 8).sum())
                for l in range(4))
    assert total == 4 * 2 * 40  # the capacities sum to N H_kv C; each head adds its window


def test_headkv_config_needs_an_existing_score_file(tmp_path):
    with pytest.raises(ConfigError, match="--head_scores"):
        CompressionConfig(method="headkv", max_capacity_prompts=64)
    with pytest.raises(ConfigError, match="--head_scores .*missing.json.* is not a file"):
        CompressionConfig(method="snapkv", allocation="headkv", max_capacity_prompts=64,
                          head_scores=str(tmp_path / "missing.json"))


# ---------------------------------------------------------------- config and composition
def test_allocation_flags_are_validated_with_their_names():
    with pytest.raises(ConfigError, match="--allocation 'zigzag'"):
        CompressionConfig(method="snapkv", max_capacity_prompts=64, allocation="zigzag")
    with pytest.raises(ConfigError, match="--method pyramidkv .* --method snapkv --allocation adakv"):
        CompressionConfig(method="pyramidkv", max_capacity_prompts=64, allocation="adakv")
    with pytest.raises(ConfigError, match="--use_pyramid"):
        CompressionConfig(method="adakv", max_capacity_prompts=64, use_pyramid=True)
    with pytest.raises(ConfigError, match="--floor"):
        CompressionConfig(method="adakv", max_capacity_prompts=64, floor=1.5)
    with pytest.raises(ConfigError, match="--head_beta"):
        CompressionConfig(method="snapkv", max_capacity_prompts=64, head_beta=0.5)
    with pytest.raises(ConfigError, match="--head_temp"):
        CompressionConfig(method="snapkv", max_capacity_prompts=64, head_temp=0.0)
    with pytest.raises(ConfigError, match="--pyramid_beta"):
        CompressionConfig(method="pyramidkv", max_capacity_prompts=64, pyramid_beta=0)


def test_methods_keep_their_original_allocation():
    base = dict(max_capacity_prompts=64)
    assert CompressionConfig(method="pyramidkv", **base).run.allocation == "pyramid"
    assert CompressionConfig(method="adakv", **base).run.allocation == "adakv"
    assert CompressionConfig(method="snapkv", **base).run.allocation == "uniform"
    assert CompressionConfig(method="snapkv", use_pyramid=True, **base).run.allocation == "pyramid"
    assert CompressionConfig(method="h2o", allocation="adakv", **base).run.allocation == "adakv"


#: scorers whose heads keep their allocated counts in tokens (MomentKV's statistics and IndexMem's
#: memory take slots of them: tests/policies/test_momentkv.py and tests/policies/test_indexmem.py check the allocations;
#: a scorer that needs a file, such as qfilter's filters, has its own tests)
SCORERS = registered_methods(uniform=True)


@pytest.mark.parametrize("method", SCORERS)
@pytest.mark.parametrize("allocation", ["uniform", "pyramid", "adakv", "headkv"])
def test_every_scorer_composes_with_every_allocation(method, allocation, tiny_head_scores):
    query, key, value = random_qkv(heads=4, kv_heads=2, length=120, seed=3)
    config = CompressionConfig(method=method, allocation=allocation, max_capacity_prompts=40, window_size=8,
                               head_scores=tiny_head_scores)
    window = config.policy.protected_count(config.window_size, 40)
    o_proj = torch.randn(64, 4 * 16, generator=torch.Generator().manual_seed(0))  # output-space scorers read it
    totals = 0
    for layer in range(3):
        out = compress_kv(query, key, value, config, layer_idx=layer, num_layers=3, o_proj_weight=o_proj,
                          rotary=rope_tables(query))
        counts = stored_counts(out)[0]
        if not config.policy.compresses_layer(layer):
            assert counts.tolist() == [120, 120]
            continue
        totals += int(counts.sum())
        assert out.keys.shape[2] == int(counts.max())
        for head in range(2):
            positions = kept(out, head=head)
            assert positions == sorted(positions) and len(set(positions)) == len(positions)
            assert set(range(120 - window, 120)) <= set(positions)
        if allocation in ("uniform", "adakv"):
            assert int(counts.sum()) == 2 * 40
    if allocation != "uniform" and all(config.policy.compresses_layer(l) for l in range(3)):
        assert totals == 3 * 2 * 40  # pyramid and HeadKV: exact over the model


def test_rows_that_fit_keep_everything_whatever_the_allocation(tiny_head_scores, tiny_lukv_curve):
    query, key, value = random_qkv(batch=2, heads=4, kv_heads=2, length=100, seed=9)
    mask = torch.ones(2, 100, dtype=torch.long)
    mask[1, :70] = 0  # row 1 has 30 tokens, under the budget of 40
    for allocation, file in [("pyramid", {}), ("adakv", {}), ("headkv", dict(head_scores=tiny_head_scores)),
                             ("lukv", dict(lukv_curve=tiny_lukv_curve))]:
        out = compress_kv(query, key, value, dict(method="snapkv", allocation=allocation, max_capacity_prompts=40,
                                                  window_size=8, **file),
                          layer_idx=1, num_layers=3, attention_mask=mask)
        assert kept(out, row=1, head=0) == list(range(30)) and kept(out, row=1, head=1) == list(range(30))


BATCH_CONFIGS = {
    "pyramidkv": dict(method="pyramidkv"),
    "pyramidkv_reference": dict(method="pyramidkv", pyramid_reference_rounding=True),
    "use_pyramid": dict(method="snapkv", use_pyramid=True),
    "adakv": dict(method="adakv"),
    "adakv_reference": dict(method="adakv", adakv_reference_allocation=True, adakv_normalize=False),
    "headkv": dict(method="headkv"),
    "headkv_outside": dict(method="headkv", headkv_window_outside=True),
    "tova_adakv": dict(method="tova", allocation="adakv"),
    "h2o_headkv": dict(method="h2o", allocation="headkv"),
}


def with_scores(options, path):
    return {**options, "head_scores": path} if "headkv" in (options["method"], options.get("allocation")) else options


@pytest.mark.parametrize("name", sorted(BATCH_CONFIGS))
@pytest.mark.parametrize("budget", [dict(max_capacity_prompts=24), dict(compression_ratio=0.5)])
def test_compress_kv_rows_of_a_left_padded_batch_equal_their_single_row_runs(name, budget, tiny_head_scores):
    lengths = [90, 64, 20]  # the last row fits in the budget
    query, key, value = random_qkv(batch=3, heads=4, kv_heads=2, length=90, seed=11)
    mask = torch.zeros(3, 90, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, 90 - length :] = 1
    config = dict(with_scores(BATCH_CONFIGS[name], tiny_head_scores), window_size=8, **budget)
    for layer in range(3):
        batched = compress_kv(query, key, value, config, layer_idx=layer, num_layers=3, attention_mask=mask)
        for row, length in enumerate(lengths):
            part = slice(90 - length, 90)
            alone = compress_kv(query[row : row + 1, :, part], key[row : row + 1, :, part],
                                value[row : row + 1, :, part], config, layer_idx=layer, num_layers=3)
            width = alone.indices.shape[-1]
            assert torch.equal(batched.indices[row, :, :width], alone.indices[0])
            assert bool((batched.indices[row, :, width:] == -1).all())
            torch.testing.assert_close(batched.keys[row, :, :width], alone.keys[0])
            torch.testing.assert_close(batched.values[row, :, :width], alone.values[0])


# ---------------------------------------------------------------- through the model
@pytest.mark.parametrize("family, backend", FAMILY_BACKENDS)
@pytest.mark.parametrize("name", ["pyramidkv", "adakv", "headkv", "tova_adakv"])
def test_budget_at_or_above_prompt_reproduces_unpatched_outputs(family, backend, name, tiny_head_scores):
    model = tiny_model(family, backend)
    input_ids, attention_mask = left_padded([70, 52, 31])
    assert_patch_reproduces_unpatched(model, family, input_ids, attention_mask, max_capacity_prompts=70,
                                      window_size=8, **with_scores(BATCH_CONFIGS[name], tiny_head_scores))


def test_a_layer_allocated_the_whole_prompt_stores_it_exactly():
    """Every allocated B_l >= L - W: the layer keeps its prompt unchanged, in order."""
    query, key, value = random_qkv(length=60)
    # C = 50, W = 8: B = 42, n_max = 82 >= L - W = 52, so layer 0 gets all 52 candidates.
    config = dict(method="snapkv", use_pyramid=True, max_capacity_prompts=50, window_size=8)
    out = compress_kv(query, key, value, config, layer_idx=0, num_layers=3)
    assert out.indices.tolist() == [[list(range(60))] * 2]
    assert torch.equal(out.keys, key) and torch.equal(out.values, value)
    last = compress_kv(query, key, value, config, layer_idx=2, num_layers=3)
    assert stored_counts(last).tolist() == [[32 + 8] * 2]


@pytest.mark.parametrize("family, backend", [("llama", "sdpa"), ("qwen2", "eager"), ("gemma3", "sdpa")])
@pytest.mark.parametrize("name", sorted(BATCH_CONFIGS))
def test_each_row_of_a_left_padded_batch_equals_its_single_row_run(family, backend, name, tiny_head_scores):
    model = tiny_model(family, backend)
    replace_for(family)(max_capacity_prompts=24, window_size=8, **with_scores(BATCH_CONFIGS[name], tiny_head_scores))
    assert_rows_match_single_row_runs(model, [90, 64, 41])


def test_stored_bytes_follow_the_per_head_budgets():
    """AdaKV's ragged counts are stored ragged (restkv.cache.segments.exact): the bytes are those of the
    tokens each head keeps, not of a cache padded to the largest head (nor a full-size cache
    with a mask); attention reads them through the padded view."""
    model = tiny_model("llama", "sdpa", num_key_value_heads=4)
    replace_for("llama")(method="adakv", max_capacity_prompts=24, window_size=8)
    out = greedy(model, random_prompt(1, 120), new_tokens=1)
    ragged = False
    for layer in out.past_key_values.layers:
        counts = layer.kept_counts[0]
        assert int(counts.sum()) == 4 * 24 and bool((counts >= 8 + int(0.2 * 16)).all())
        width = int(counts.max())
        ragged |= len(set(counts.tolist())) > 1
        assert layer.kept_keys.shape == (1, 4, width, 16) and layer.kept_values.shape == (1, 4, width, 16)
        kept = int(counts.sum())
        padded = 2 * 4 * width * 16 * 4 + 4 * width * 4
        ragged_bytes = 2 * kept * 16 * 4 + kept * 4 + 2 * 4 * 4  # keys, values (fp32), columns, counts (int32)
        assert layer.used_nbytes() == (ragged_bytes if len(set(counts.tolist())) > 1 else padded)
        assert width < 120
    assert ragged
    report = cache_report(out.past_key_values)
    assert all(r.compressed for r in report)


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("[1, 2]", "must hold one JSON object"),
        ('{"0-0": [1.0], "zero-1": [2.0]}', "key 'zero-1' is not"),
        ('{"0-0": []}', "0-0 must be a non-empty list of numbers"),
        ('{"0-0": [0.0], "0-1": [0.0]}', "not all zero"),
        ("{not json", "cannot be read as JSON"),
    ],
)
def test_a_malformed_head_score_file_fails_when_the_config_is_built(tmp_path, content, fragment):
    path = tmp_path / "heads.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match="--head_scores") as error:
        CompressionConfig(method="headkv", max_capacity_prompts=64, head_scores=str(path))
    assert fragment in str(error.value)


def test_per_layer_ratios_give_each_layer_its_ratio_of_the_row_capped_by_the_run_budget():
    query, key, value = random_qkv(heads=4, kv_heads=2, length=100, seed=5)
    options = dict(method="snapkv", allocation="per_layer", layer_ratios=(0.2, 0.5, 0.9), max_capacity_prompts=60,
                   window_size=8)
    counts = [stored_counts(compress_kv(query, key, value, options, layer_idx=layer, num_layers=3))[0].tolist()
              for layer in range(3)]
    assert counts == [[60, 60], [50, 50], [10, 10]]  # 80 capped at 60
    with pytest.raises(ConfigError, match="give --layer_ratios"):
        CompressionConfig(method="snapkv", allocation="per_layer", max_capacity_prompts=60)
    with pytest.raises(ConfigError, match="--layer_ratios must be fractions"):
        CompressionConfig(method="snapkv", allocation="per_layer", layer_ratios=(1.5,), max_capacity_prompts=60)


@pytest.mark.parametrize("ratios", [(0.5,) * 30, (0.5, 0.5)])
def test_per_layer_ratios_are_one_per_layer_of_the_model(ratios):
    options = dict(method="snapkv", allocation="per_layer", layer_ratios=ratios, max_capacity_prompts=32,
                   window_size=4)
    assert_refused_when_configured(options, f"--layer_ratios gives {len(ratios)} ratios; the model has 3 layers")
    query, key, value = random_qkv(length=50)
    with pytest.raises(ConfigError, match=f"--layer_ratios gives {len(ratios)} ratios; the model has 3 layers"):
        compress_kv(query, key, value, options, layer_idx=0, num_layers=3)


def test_lukv_heads_keep_their_curve_share_with_the_layer_total_rounded_by_largest_remainders(tmp_path):
    import numpy as np

    curve = np.zeros((99, 3, 2), dtype=np.float32)
    curve[59] = [[0.5, 0.7], [0.333, 0.867], [0.9, 0.9]]  # ratio 60%: prune ratios per layer and KV head
    path = tmp_path / "curve.npy"
    np.save(path, curve)
    query, key, value = random_qkv(heads=4, kv_heads=2, length=100, seed=6)
    options = dict(method="snapkv", allocation="lukv", lukv_curve=str(path), compression_ratio=0.6, window_size=4)
    counts = [stored_counts(compress_kv(query, key, value, options, layer_idx=layer, num_layers=3))[0].tolist()
              for layer in range(3)]
    # 66.7 + 13.3 rounds to 80 in all: the larger remainder (.7) gets the extra token
    assert counts == [[50, 30], [67, 13], [10, 10]]


def test_lukv_curve_errors_name_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="give --lukv_curve"):
        CompressionConfig(method="snapkv", allocation="lukv", compression_ratio=0.5)
    (tmp_path / "bad.npy").write_text("not numpy")
    with pytest.raises(ConfigError, match="--lukv_curve .*bad.npy.*: not a .npy array"):
        CompressionConfig(method="snapkv", allocation="lukv", lukv_curve=str(tmp_path / "bad.npy"), compression_ratio=0.5)
    flat = write_curve(tmp_path / "flat.npy", torch.zeros(10, 2))
    with pytest.raises(ConfigError, match=r"expected \[99, layers, KV heads\]"):
        CompressionConfig(method="snapkv", allocation="lukv", lukv_curve=flat, compression_ratio=0.5)


def _npz(path):
    import numpy as np

    np.savez(path, curve=np.zeros((99, 3, 2)))
    return str(path)


@pytest.mark.parametrize("write, message", [
    (lambda path: path.write_bytes(b"") or str(path), "not a .npy array"),
    (lambda path: _npz(path.with_suffix(".npz")), "not a .npy array"),
    (lambda path: write_curve(path, [[["a", "b"]] * 3] * 99), "holds <U1 values, not prune ratios"),
    (lambda path: write_curve(path, torch.full((99, 3, 2), float("nan"))), "the curve holds NaN"),
    (lambda path: write_curve(path, -torch.ones(99, 3, 2)), r"prune ratios must lie in \[0, 1\]; the curve holds -1"),
    (lambda path: write_curve(path, torch.full((99, 3, 2), 1.5)), r"prune ratios must lie in \[0, 1\]; .* 1.5"),
])
def test_a_curve_that_is_not_one_is_refused_when_the_config_is_built(tmp_path, write, message):
    """Negative ratios would keep every token (compression off), NaN fail at the first prefill."""
    path = write(tmp_path / "curve.npy")
    with pytest.raises(ConfigError, match=f"--lukv_curve .*curve.np.*{message}"):
        CompressionConfig(method="snapkv", allocation="lukv", lukv_curve=path, max_capacity_prompts=32, window_size=4)


def test_a_curve_of_another_model_is_refused_when_the_model_is_configured(tmp_path):
    path = write_curve(tmp_path / "other.npy", torch.full((99, 30, 2), 0.5))
    assert_refused_when_configured(dict(method="snapkv", allocation="lukv", lukv_curve=path, max_capacity_prompts=32,
                                        window_size=4),
                                   r"--lukv_curve .*other.npy.*: the curve is \[99, 30, 2\]; the model needs "
                                   r"\[99, 3, 2\]")
    query, key, value = random_qkv(length=60)
    with pytest.raises(ConfigError, match=r"the curve is \[99, 30, 2\]; the model needs \[99, 3, 2\]"):
        compress_kv(query, key, value, dict(method="snapkv", allocation="lukv", lukv_curve=path,
                                            max_capacity_prompts=32, window_size=4), layer_idx=0, num_layers=3)


def test_lukv_never_keeps_more_than_the_runs_budget_in_all(tmp_path):
    """A curve whose rows keep more than their ratio says (here about 55% where the run keeps 32%) is
    scaled down: the heads share the model's budget in proportion to the curve's keep rates."""
    curve = torch.rand(99, 3, 2, generator=torch.Generator().manual_seed(0)) * 0.9
    path = write_curve(tmp_path / "loose.npy", curve)
    query, key, value = random_qkv(heads=4, kv_heads=2, length=200, seed=3)
    options = dict(method="snapkv", allocation="lukv", lukv_curve=path, max_capacity_prompts=64, window_size=8)
    counts = torch.stack([stored_counts(compress_kv(query, key, value, options, layer_idx=layer, num_layers=3))[0]
                          for layer in range(3)])
    assert int(counts.sum()) == 3 * 2 * 64 and bool((counts >= 8).all())
    keep = 1 - curve[67]  # ratio 68%: 64 of 200 tokens
    order = torch.argsort(keep.flatten(), stable=True)
    assert counts.flatten()[order].tolist() == sorted(counts.flatten().tolist())  # more kept where the curve keeps more


def test_a_curve_rewritten_in_place_is_read_again(tmp_path):
    path = tmp_path / "curve.npy"
    query, key, value = random_qkv(heads=4, kv_heads=2, length=200, seed=3)
    options = dict(method="snapkv", allocation="lukv", lukv_curve=str(path), max_capacity_prompts=64, window_size=8)
    kept_counts = []
    for prune in (0.9, 0.7):
        write_curve(path, torch.full((99, 3, 2), prune))
        out = compress_kv(query, key, value, options, layer_idx=0, num_layers=3)
        kept_counts.append(stored_counts(out)[0].tolist())
    assert kept_counts == [[20, 20], [60, 60]]


@pytest.mark.parametrize("options", [dict(prefill_chunk_size=64), dict(decode_budget=48)])
def test_lukv_refuses_compressing_layers_again(options, tiny_lukv_curve):
    flag = "--" + next(iter(options))
    with pytest.raises(ConfigError, match=f"--allocation lukv .*; {flag}"):
        CompressionConfig(method="snapkv", allocation="lukv", lukv_curve=tiny_lukv_curve, max_capacity_prompts=32,
                          window_size=4, **options)


def test_head_scores_of_another_model_are_refused_when_the_model_is_configured(tmp_path):
    path = random_head_scores(tmp_path / "other.json", 30, 9)
    assert_refused_when_configured(dict(method="headkv", head_scores=path, max_capacity_prompts=32, window_size=4),
                                   "--head_scores: .*other.json.* has 270 heads, the model has 3 layers x 4 query "
                                   "heads")
