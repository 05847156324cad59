"""kvpress 0.5.5's presses, token for token: the parity fixtures in ``data/fixtures/golden_kvpress``.

Each case of ``tests/golden_kvpress_cases.json`` names the restkv options that reproduce one
fixture case. The test rebuilds the fixtures' tiny Llama from its config and weights,
prefills their 384-token prompt through ``restkv.compression(model, **options)`` and compares,
per layer and KV head, the positions the cache keeps (``restkv.cache.kept_positions``) with the
case's ``kept_mask``. restkv breaks ties towards the lower position, so where the fixture
records that tie-breaking changes the kept set (``kept_mask_tiebreak_low``), that is the set
restkv must keep, and the number of kept entries it then swaps for others of ``kept_mask``
must be exactly the fixture's count. Raw scores are compared too (relative tolerance 1e-4, float32), as the
policy's ``score(ctx)`` returned them during the run.

The Finch cases run a second time from FinchPress' own input, its delimiter in the prompt (the table's
``delimited``). Two cases are not in the table: ``chunkkv_snapkv_r0.8`` and ``block_snapkv_r0.5`` differ by
design (tests below show the documented reasons). Docs of each policy say where it departs from
kvpress and why.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch

import restkv
from restkv.cache import kept_positions
from restkv.integrations.transformers.compat import output_cache
from restkv.integrations.transformers.reconstruction_prompt import (KVPRESS_CLOSING, KVPRESS_CONTINUATION,
                                                                    set_reconstruction_prompt)

FIXTURES = Path(__file__).resolve().parents[2] / "data" / "fixtures" / "golden_kvpress"
TABLE = json.loads((Path(__file__).resolve().parents[1] / "golden_kvpress_cases.json").read_text())
CASES = TABLE["cases"]


class ByteTokenizer:
    """The fixtures' tokenizer for KVzip's replay prompt: one id per byte, no template."""

    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = False):
        return SimpleNamespace(input_ids=list(text.encode()))


@functools.cache
def metadata() -> dict:
    """The fixtures' ``cases.json`` entries of the Llama cases, by case name."""
    entries = json.loads((FIXTURES / "cases.json").read_text())
    return {entry["case"].removeprefix("llama__"): entry for entry in entries if entry["model"] == "llama"}


@functools.cache
def fixture(case: str) -> dict:
    with np.load(FIXTURES / f"case_llama__{case}.npz") as arrays:
        return {name: arrays[name] for name in arrays.files}


def tiny_llama(attn_implementation: str):
    """The fixtures' Llama: built from its config, its weights loaded strictly."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**json.loads((FIXTURES / "llama_config.json").read_text()))
    config._attn_implementation = attn_implementation
    model = LlamaForCausalLM(config)
    model.load_state_dict(load_file(str(FIXTURES / "llama_weights.safetensors")), strict=True)
    return model.eval()


def prompt() -> torch.Tensor:
    return torch.from_numpy(np.load(FIXTURES / "prompt_ids.npy"))[None]


def recorded_draw(case: str):
    """A stand-in for the drawing function named in the table's ``inject``: the fixture's draw of the
    scoring layer (kvpress draws once per layer, in layer order)."""
    rng = metadata()[case]["rng"]
    kind, layers = ("randn", rng["randn_layers"]) if rng["randn_calls"] else ("rand", rng["rand_layers"])
    draws = {layer: torch.from_numpy(fixture(case)[f"{kind}{i}"]) for i, layer in enumerate(layers)}
    return lambda ctx, *args: draws[ctx.layer_idx]


@functools.cache
def replay(case: str, **changes) -> tuple[list[list[list[int]]], dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Prefill the fixtures' prompt with the case's options (``changes`` applied): per layer and KV
    head the kept positions, and per layer the policy's scores ``[H_kv, N]`` with the mask of the
    positions that competed (not protected)."""
    options = {**case_options(case), **changes}
    if restkv.CompressionConfig(**options).run.observation == "reconstruction":
        options.setdefault("reconstruction_prompt", "instruction")  # kvpress' presses repeat after its instruction
    model = tiny_llama(metadata()[case]["attn_implementation"])
    scores = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        config = stack.enter_context(restkv.compression(model, **options))
        if config.run.observation == "reconstruction":
            set_reconstruction_prompt(model, ByteTokenizer(), closing=KVPRESS_CLOSING, continuation=KVPRESS_CONTINUATION)
        if case in TABLE["inject"] and not changes:
            module, name = TABLE["inject"][case].rsplit(".", 1)
            stack.enter_context(mock.patch.object(importlib.import_module(module), name, recorded_draw(case)))
        policy_class = type(config.policy)
        original = policy_class.score

        def recording(policy, ctx):
            result = original(policy, ctx)
            scores[ctx.layer_idx] = (result[0].detach().clone(), ctx.candidates[0].clone())
            return result

        stack.enter_context(mock.patch.object(policy_class, "score", recording))
        cache = output_cache(model.model(input_ids=prompt(), use_cache=True))
    kept = [layer.exact[0] for layer in kept_positions(cache)]
    return kept, scores


def case_options(case: str) -> dict:
    """The table's options of ``case``, with ``{fixtures}`` in a value replaced by the fixtures' folder."""
    return {name: value.replace("{fixtures}", str(FIXTURES)) if isinstance(value, str) else value
            for name, value in CASES[case].items()}


def as_mask(kept: list[list[list[int]]], shape) -> np.ndarray:
    mask = np.zeros(shape, dtype=np.uint8)
    for layer, heads in enumerate(kept):
        for head, positions in enumerate(heads):
            mask[layer, head, positions] = 1
    return mask


def test_the_rebuilt_model_reproduces_the_reference_prefill():
    """Layer 0 (embeddings only) bit for bit; the later layers within float32 noise (bitwise on the
    machine that recorded the fixtures; CPU kernels differ between machines)."""
    from safetensors.torch import load_file

    reference = load_file(str(FIXTURES / "reference_llama_sdpa.safetensors"))
    with torch.no_grad():
        cache = output_cache(tiny_llama("sdpa").model(input_ids=prompt(), use_cache=True))
    for name in ("keys", "values"):
        ours = torch.stack([getattr(layer, name)[0] for layer in cache.layers])
        assert torch.equal(ours[0], reference[name][0])
        torch.testing.assert_close(ours, reference[name], rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_restkv_keeps_the_kvpress_set_of_every_layer_and_head(case):
    data, meta = fixture(case), metadata()[case]
    ours = as_mask(replay(case)[0], data["kept_mask"].shape)
    if case in TABLE["kept_fewer"]:
        missing = data["kept_mask"].astype(bool) & ~ours.astype(bool)
        assert not bool((ours.astype(bool) & ~data["kept_mask"].astype(bool)).any())
        assert int(missing.sum()) == TABLE["kept_fewer"][case]
        # The entries restkv's rounding leaves out are the lowest-scored of those kvpress keeps.
        kept_scores = data["score_val"][data["kept_mask"].astype(bool) & (np.arange(384) >= 4)]
        assert np.sort(data["score_val"][missing]).tolist() == np.sort(kept_scores)[: int(missing.sum())].tolist()
        return
    if case in TABLE["float_ties"]:
        # kvpress' exact ties are a few 1e-7 apart here: each kept entry swapped for another is one
        # of a tie of the kvpress scores at that row's boundary, within the fixture's swappable count.
        theirs = data["kept_mask"].astype(bool)
        swapped = np.argwhere(ours.astype(bool) & ~theirs)
        assert len(swapped) <= meta["ties"]["swappable_tokens"]
        assert int((~ours.astype(bool) & theirs).sum()) == len(swapped)
        scores = data[TABLE["scores"][case]["array"]]
        for layer, head, position in swapped:
            boundary = scores[layer, head][theirs[layer, head]].min()
            assert scores[layer, head, position] == boundary
        return
    # restkv breaks ties towards the lower position: kvpress' set under that tie-break.
    expected = data.get("kept_mask_tiebreak_low", data["kept_mask"])
    assert np.array_equal(ours, expected)
    # The fixture counts the kept entries that the tie-break swaps for others.
    swapped = ours.astype(bool) & ~data["kept_mask"].astype(bool)
    assert int(swapped.sum()) == meta["determinism"]["n_kept_entries_changed_tiebreak_low"]


@pytest.mark.parametrize("case", sorted(TABLE["scores"]))
def test_restkv_scores_equal_the_kvpress_scores(case):
    spec = TABLE["scores"][case]
    reference = torch.from_numpy(fixture(case)[spec["array"]])
    scores = replay(case)[1]
    assert sorted(scores) == list(range(reference.shape[0]))
    for layer, (ours, competed) in scores.items():
        compared = competed.clone()
        compared[: spec.get("first", 0)] = False
        compared[spec.get("stop", compared.shape[0]) :] = False
        theirs = reference[layer][:, compared]
        # Relative to each value and to the layer's score scale: scores that cross 0
        # (cosines, z-scores, dot products) have no relative precision of their own there.
        torch.testing.assert_close(ours[:, compared] * spec["scale"], theirs, rtol=1e-4,
                                   atol=1e-4 * float(theirs.abs().max()))


# ---------------------------------------------------------------- the fixtures' inputs
def test_kvzip_reconstruction_replays_the_ids_kvpress_replayed():
    prefix = set_reconstruction_prompt(tiny_llama("sdpa"), ByteTokenizer(), closing=KVPRESS_CLOSING).before(None)
    replayed = torch.from_numpy(fixture("kvzip_r0.5")["replay_ids_c0"]).long()
    assert torch.equal(torch.cat([prefix, prompt()[0]]), replayed)


@pytest.mark.parametrize("case", sorted(TABLE["delimited"]))
def test_finch_finds_the_window_from_kvpress_delimiter_and_keeps_the_kvpress_set(case):
    """FinchPress' own input (the prompt with delimiter 511 before position 320) through ``--finch_delimiter``:
    the delimiter is taken out before the model runs and the 64 tokens after it are the window, so the cache
    holds the 384-token prompt and keeps the case's set; the scores are those of the window_size run."""
    data = fixture(case)
    model = tiny_llama(metadata()[case]["attn_implementation"])
    ids = torch.from_numpy(np.load(FIXTURES / "finch_input_ids.npy"))[None]
    with torch.no_grad(), restkv.compression(model, **TABLE["delimited"][case]):
        cache = output_cache(model.model(input_ids=ids, use_cache=True))
    assert cache.get_seq_length() == 384
    ours = as_mask([layer.exact[0] for layer in kept_positions(cache)], data["kept_mask"].shape)
    assert np.array_equal(ours, data.get("kept_mask_tiebreak_low", data["kept_mask"]))
    assert np.array_equal(ours, as_mask(replay(case)[0], data["kept_mask"].shape))


def test_finch_input_is_the_prompt_whose_question_window_is_the_cases_window():
    """FinchPress strips its delimiter: the model sees the prompt, and the tokens after
    the delimiter are the window restkv's Finch is given."""
    ids, delimiter = np.load(FIXTURES / "finch_input_ids.npy"), 511
    assert np.array_equal(ids[ids != delimiter], prompt()[0].numpy())
    window = len(ids) - 1 - int(np.flatnonzero(ids == delimiter)[0])
    assert window == CASES["finch_r0.5"]["window_size"] == CASES["finch_norerotate_r0.8"]["window_size"]


def test_the_query_stats_command_computes_the_statistics_kvpress_collected():
    """ExpectedAttentionStats of the fixtures' Llama on calib_ids.npy (first 4 queries left out, n - 1)."""
    from safetensors.torch import load_file

    from restkv.tools.query_stats import collect_query_stats

    ids = np.load(FIXTURES / "calib_ids.npy").tolist()
    mean, cov = collect_query_stats(tiny_llama("sdpa"), [ids], n_sink=4)
    reference = load_file(str(FIXTURES / "ea_stats_llama.safetensors"))
    torch.testing.assert_close(mean, reference["query_mean"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cov, reference["query_cov"], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- where restkv's default differs
def test_pyramid_default_gives_the_last_layer_candidates_where_kvpress_keeps_only_its_window():
    """kvpress spreads the whole budget, window included, over its pyramid; restkv
    keeps the 64-token window on top of a pyramid of the 128 candidates per head."""
    kvpress = fixture("pyramidkv_r0.5")["n_kept"][:, 0].tolist()
    ours = [len(heads[0]) for heads in replay("pyramidkv_r0.5", pyramid_kvpress_schedule=False)[0]]
    assert kvpress == [320, 235, 149, 64] and ours == [314, 233, 151, 70]
    assert sum(ours) == sum(kvpress)


def test_pyramid_kvpress_schedule_at_ratio_08_rounds_its_fallback_where_restkv_floors():
    """At ratio 0.8 kvpress' bounds fail and it keeps round(384 * 0.2) = 77 per head;
    restkv's budget is floor(76.8) = 76 (the table gives the case its 77 directly): the 76 it keeps
    are kvpress' 77 less one."""
    data = fixture("pyramidkv_r0.8")
    kept = as_mask(replay("pyramidkv_r0.8", max_capacity_prompts=None, compression_ratio=0.8)[0],
                   data["kept_mask"].shape)
    assert kept.sum(axis=-1).tolist() == [[76, 76]] * 4 and data["n_kept"].tolist() == [[77, 77]] * 4
    assert not bool((kept.astype(bool) & ~data["kept_mask"].astype(bool)).any())


def test_lagkv_default_keeps_the_sinks_and_the_newest_tokens_where_kvpress_drops_the_sinks():
    """With lag 128 on 384 tokens, the 4 sinks and the 252-token tail (all scored 1 by kvpress) exceed
    the 192-token budget; kvpress' top-k keeps positions 192-383, dropping the sinks.
    restkv keeps the sinks and the 188 newest."""
    data = fixture("lagkv_default_r0.5")
    ours = replay("lagkv_default_r0.5", lagkv_kvpress_scores=False)[0]
    for layer in range(4):
        for head in range(2):
            assert np.flatnonzero(data["kept_mask"][layer, head]).tolist() == list(range(192, 384))
            assert ours[layer][head] == [0, 1, 2, 3] + list(range(196, 384))


def test_chunk_press_default_scores_each_chunk_with_its_own_positions():
    """kvpress' ChunkPress hands SnapKV the whole prompt's RoPE tables, which turn a chunk's window
    queries to the prompt's last positions; only --chunk_press_kvpress_rope reproduces it, the
    default keeps other tokens."""
    data = fixture("chunkpress_snapkv_w16_c128_r0.5")
    ours = as_mask(replay("chunkpress_snapkv_w16_c128_r0.5", chunk_press_kvpress_rope=False)[0],
                   data["kept_mask"].shape)
    assert (ours.sum(axis=-1) == data["n_kept"]).all() and int((ours != data["kept_mask"]).sum()) > 100


def test_block_press_first_block_scores_are_kvpress_once_its_window_queries_take_the_prompts_last_positions():
    """kvpress' BlockPress(SnapKV) scores its first block (tokens 0-319) with window queries turned to
    the whole prompt's last positions; turned so, restkv's first-block scores are
    kvpress', with their own positions they differ, and so do the kept sets (later blocks also pool
    along kvpress' top-k order and recompute queries from mixed hidden-state slices)."""
    from restkv.pipeline.inputs import LayerInputs
    from restkv.pipeline.plan import plan_layer
    from restkv.scoring.rope import rotate, unrotate
    from restkv.switches import block_press

    data, first_blocks = fixture("block_snapkv_r0.5"), {}
    original = block_press.choose_as_prompt

    def recording(config, ctx, query, key, value, share, rotary=None):
        first_blocks.setdefault(ctx.layer_idx, (config, ctx, query, key, value))
        return original(config, ctx, query, key, value, share, rotary)

    options = dict(method="snapkv", compression_ratio=0.5, window_size=64, block_press=True, block_press_size=128)
    model = tiny_llama("sdpa")
    with torch.no_grad(), mock.patch.object(block_press, "choose_as_prompt", recording), \
            restkv.compression(model, **options):
        cache = output_cache(model.model(input_ids=prompt(), use_cache=True))
    for layer, (config, ctx, query, key, value) in first_blocks.items():
        assert query.shape[2] == 320 and torch.equal(key[0, :, :, 0], ctx.key[0, :, :320, 0])
        cos, sin = ctx.rotary
        turned = rotate(unrotate(query[:, :, -64:], cos[:, 256:320], sin[:, 256:320]), cos[:, -64:], sin[:, -64:])
        scores = {}
        for name, window in (("own", query[:, :, -64:]), ("kvpress", turned)):
            plan = plan_layer(config, torch.ones(1, 320, dtype=torch.bool), layer, 4, budgets=[192])
            piece = LayerInputs(torch.cat([query[:, :, :-64], window], dim=2), key, value, plan, ctx.facts)
            scores[name] = config.policy.score(piece)[0, :, :256] / 64
        assert data["pos_inner_L%d_c0" % layer][:, :256].tolist() == [list(range(256))] * 2
        theirs = torch.from_numpy(data["scores_inner_L%d_c0" % layer][:, :256])
        torch.testing.assert_close(scores["kvpress"], theirs, rtol=1e-4, atol=1e-4 * float(theirs.abs().max()))
        assert not torch.allclose(scores["own"], theirs, rtol=1e-2, atol=1e-2 * float(theirs.abs().max()))
    ours = as_mask([layer.exact[0] for layer in kept_positions(cache)], data["kept_mask"].shape)
    assert (ours.sum(axis=-1) == data["n_kept"]).all() and int((ours & ~data["kept_mask"].astype(bool)).sum()) > 100


def test_chunkkv_keeps_the_window_where_kvpress_counts_chunks_and_drops_part_of_it():
    """At ratio 0.8 kvpress keeps int(20 x 0.2) = 3 chunks, 3 of the 4 window chunks (44 tokens;
    its top-k's tie-breaking picks which); restkv keeps the 64-token window and, as no chunk fits
    whole in the 12 tokens the 76-token budget leaves, the best chunk's best 12 tokens."""
    data = fixture("chunkkv_snapkv_r0.8")
    ours = replay("chunkkv_snapkv_r0.5", compression_ratio=0.8)[0]
    assert data["n_kept"].tolist()[0] == [44, 44]
    for layer in ours:
        for head in layer:
            assert len(head) == 76 and head[-64:] == list(range(320, 384)) and len({p // 20 for p in head[:12]}) == 1


def test_noncausal_default_scale_and_last_chunk_change_what_is_kept():
    """Only --noncausal_kvpress_logits reproduces kvpress (no 1/sqrt(d), the padded last
    chunk); tests/policies/test_kvpress_scorers.py pins both differences on small tensors."""
    data = fixture("noncausal_attn_r0.5")
    ours = as_mask(replay("noncausal_attn_r0.5", noncausal_kvpress_logits=False)[0], data["kept_mask"].shape)
    assert (ours.sum(axis=-1) == data["n_kept"]).all() and not np.array_equal(ours, data["kept_mask"])


def test_similarity_merge_stores_the_values_kvpress_merging_press_stores():
    """MergingPress of Knorm: every kept token's value, merged, equals kvpress' at the same position."""
    case = "merging_knorm_r0.5"
    data = fixture(case)
    model = tiny_llama("sdpa")
    with torch.no_grad(), restkv.compression(model, **case_options(case)):
        cache = output_cache(model.model(input_ids=prompt(), use_cache=True))
    for layer, compressed in enumerate(cache.layers):
        _, values, columns = compressed.kept_tokens()
        for head in range(2):
            order = data[f"order_L{layer}"][head].tolist()
            theirs = torch.from_numpy(data[f"merged_values_L{layer}"][head])
            ours = values[0, head][torch.tensor([columns[0, head].tolist().index(p) for p in order])]
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_think_alone_zeroes_kvpress_thinks_channels_through_the_pipeline():
    """ThinKPress on its own (no token dropped): a budget of the whole prompt, ThinK's 32-query
    window; every layer's stored keys keep the channels kvpress keeps."""
    from restkv.cache.segments.pruned_keys import PrunedKeyTokens

    case = "think_k0.5"
    zeroed = torch.from_numpy(fixture(case)["zeroed_key_channels"]).bool()
    model = tiny_llama("sdpa")
    with torch.no_grad(), restkv.compression(model, **case_options(case)):
        cache = output_cache(model.model(input_ids=prompt(), use_cache=True))
    for layer, compressed in enumerate(cache.layers):
        (pruned,) = [segment for segment in compressed.segments() if isinstance(segment, PrunedKeyTokens)]
        dropped = torch.ones(2, 32, dtype=torch.bool).scatter(1, pruned.channels[0], False)
        assert torch.equal(dropped, zeroed[layer])


def test_think_channels_are_kvpress_thinks_given_its_own_32_query_window():
    """restkv's --think scores key channels with the --window_size queries (64 here, SnapKV's window);
    kvpress' ThinKPress has its own window of 32. Fed those 32 queries, restkv's channel score zeroes
    exactly kvpress' channels in every layer and head (the kept tokens are SnapKV's either way)."""
    from safetensors.torch import load_file

    from restkv.integrations.transformers.capture import attention_inputs
    from restkv.pipeline.inputs import LayerInputs
    from restkv.pipeline.plan import plan_layer
    from restkv.scoring.selection import gather_columns

    case = "composed_snapkv_think_r0.5"
    reference = load_file(str(FIXTURES / "reference_llama_sdpa.safetensors"))
    model, kept = tiny_llama("sdpa"), replay(case)[0]
    config = restkv.CompressionConfig(**{**case_options(case), "window_size": 32})
    zeroed = torch.from_numpy(fixture(case)["zeroed_key_channels"]).bool()
    for layer in range(4):
        hidden = reference["attn_input"][layer][None]
        with torch.no_grad():
            rotary = model.model.rotary_emb(hidden, torch.arange(384)[None])
            query, key, value = attention_inputs(model.model.layers[layer].self_attn, hidden, rotary)
        ctx = LayerInputs(query, key, value, plan_layer(config, torch.ones(1, 384, dtype=torch.bool), layer, 4))
        columns = torch.tensor([kept[layer]])
        channels = config.switch("think").choose_channels(ctx, gather_columns(key, columns), columns)[0]
        dropped = torch.ones(2, 32, dtype=torch.bool).scatter(1, channels, False)
        assert torch.equal(dropped, zeroed[layer])
