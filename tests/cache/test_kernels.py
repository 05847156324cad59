"""The read kernels and the segments of a compressed layer: every kernel equals the eager float32
reference, partials merge into one softmax, and a decode step over exact tokens writes in place."""

import math

import pytest
import torch
from tiny_models import FAMILY_BACKENDS, decode_in_chunks, left_padded, replace_for, tiny_model

from restkv.cache import CompressedLayer
from restkv.cache.partial import KERNELS, Partial, Probe, merge, reference_kernel, use_kernel
from restkv.cache.segments.base import MIN_SPARE
from restkv.cache.segments.dense import DenseTokens
from restkv.cache.segments.exact import exact_tokens
from restkv.cache.segments.pruned_keys import PrunedKeyTokens
from restkv.cache.segments.quantized import QuantizedTokens
from restkv.cache.segments.ragged import RaggedTokens
from restkv.integrations.transformers.compat import with_cache
from restkv.integrations.transformers.generation import prefill

CPU_KERNELS = [name for name in KERNELS if name != "flash"]  # flash-attn runs on CUDA (tests/test_cuda.py)


def block(seed=0, batch=2, kv_heads=2, groups=3, q_len=1, length=37, dim=16):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, kv_heads * groups, q_len, dim, generator=generator)
    keys = torch.randn(batch, kv_heads, length, dim, generator=generator)
    values = torch.randn(batch, kv_heads, length, dim, generator=generator)
    return query, keys, values


def assert_partials_close(ours: Partial, reference: Partial, fields=("output", "lse", "peak", "count")):
    for name in fields:
        mine, theirs = getattr(ours, name), getattr(reference, name)
        assert mine is not None and theirs is not None, name
        finite = torch.isfinite(theirs)
        assert torch.equal(finite, torch.isfinite(mine)), name
        torch.testing.assert_close(mine.float().where(finite, 0), theirs.float().where(finite, 0), rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("case", ["all visible", "holes", "question chunk", "sliding window", "a row sees nothing"])
def test_every_kernel_equals_the_eager_reference(kernel, case):
    q_len = 4 if case == "question chunk" else 1
    query, keys, values = block(q_len=q_len)
    length = keys.shape[2]
    columns = torch.arange(length).expand(2, 2, -1).clone()
    if case == "holes":
        columns[0, 1, ::3] = -1
    if case == "a row sees nothing":
        columns[1, 0] = -1
    window = 10 if case == "sliding window" else None
    probe = Probe(query, 2, length - q_len, 0.25, sliding_window=window, need_lse=True,
                  need_peak=True, need_count=True)
    visible = probe.visibility(columns)
    expected = reference_kernel(probe, keys, values, visible)
    with use_kernel(kernel):
        ours = KERNELS[kernel](probe, keys, values, visible)
    assert_partials_close(ours, expected)
    # The reference against its definition: a masked softmax of the query heads over their KV head.
    logits = (query @ keys.repeat_interleave(3, dim=1).transpose(-1, -2)) * 0.25
    grouped = visible.expand(2, 2, 3 * q_len, length).reshape(2, 2, 3, q_len, length).reshape(2, 6, q_len, length)
    weights = torch.softmax(logits.masked_fill(~grouped, float("-inf")), dim=-1).nan_to_num(0.0)
    direct = weights @ values.repeat_interleave(3, dim=1)
    torch.testing.assert_close(probe.interface(expected.output), direct.transpose(1, 2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_an_output_only_read_equals_the_reference_output(kernel):
    query, keys, values = block()
    probe = Probe(query, 2, 40, 0.25)
    with use_kernel(kernel):
        ours = KERNELS[kernel](probe, keys, values, None)
    torch.testing.assert_close(ours.output.float(), reference_kernel(probe, keys, values, None).output,
                               rtol=1e-5, atol=1e-6)


def test_partials_of_disjoint_keys_merge_into_one_softmax():
    query, keys, values = block(length=60)
    probe = Probe(query, 2, 60, 0.25, need_lse=True, need_peak=True, need_count=True)
    whole = reference_kernel(probe, keys, values, None)
    cuts = [0, 7, 31, 60]
    parts = [reference_kernel(probe, keys[:, :, a:b], values[:, :, a:b], None) for a, b in zip(cuts, cuts[1:])]
    hidden = torch.zeros(2, 2, 1, 5, dtype=torch.bool)  # a part nobody sees changes nothing
    parts.append(reference_kernel(probe, keys[:, :, :5], values[:, :, :5], hidden))
    assert bool(torch.isneginf(parts[-1].lse).all()) and not bool(parts[-1].output.any())
    assert_partials_close(merge(parts), whole)


SEGMENT_CONFIGS = {
    "dense": dict(method="snapkv"),
    "ragged": dict(method="adakv"),
    "residual entries": dict(method="snapkv", residual=True, residual_no_validation=True, residual_fixed_ratio=0.25),
    "residual, separate softmax": dict(method="snapkv", residual=True, residual_no_validation=True,
                                       residual_separate_softmax=True),
    "moment entry": dict(method="momentkv", max_capacity_prompts=40),
    "pruned keys": dict(method="think", recent_size=4),
    "quantised blocks": dict(method="snapkv", quant_method="kivi", nbits=8, quant_group_size=4,
                             quant_residual_length=4),
    "memory correction": dict(method="indexmem", max_capacity_prompts=40, indexmem_features=4),
}
SEGMENT_CASES = [(family, backend, "dense") for family, backend in FAMILY_BACKENDS] + \
    [(family, backend, "ragged") for family, backend in FAMILY_BACKENDS] + \
    [(family, backend, kind) for family, backend in (("llama", "sdpa"), ("gemma3", "eager"), ("qwen2", "eager"))
     for kind in SEGMENT_CONFIGS if kind not in ("dense", "ragged")]


@pytest.mark.parametrize("family, backend, kind", SEGMENT_CASES)
def test_decode_through_every_segment_kind_equals_the_reference_kernel(family, backend, kind):
    """A left-padded batch decoded (a 3-token chunk, then single tokens, past a quantised block)
    through the default kernels gives the eager reference's logits."""
    model = tiny_model(family, backend)
    options = {"max_capacity_prompts": 24, "window_size": 8, **SEGMENT_CONFIGS[kind]}
    replace_for(family)(**options)
    input_ids, attention_mask = left_padded([60, 44])
    step = torch.tensor([[7, 9, 11], [5, 6, 8]])
    fast = decode_in_chunks(model, prefill(model, input_ids, attention_mask), attention_mask, step)
    with use_kernel("reference"):
        cache = prefill(model, input_ids, attention_mask)
        reference = decode_in_chunks(model, cache, attention_mask, step)
    assert any(isinstance(layer, CompressedLayer) for layer in cache.layers)
    for ours, theirs in zip(fast, reference, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


GATHERED_CONFIGS = {kind: SEGMENT_CONFIGS[kind] for kind in ("pruned keys", "quantised blocks")} | {
    "pruned ragged keys": dict(method="adakv", think=True, recent_size=4)}


@pytest.mark.parametrize("kind", list(GATHERED_CONFIGS))
@pytest.mark.parametrize("family, backend", [("llama", "sdpa"), ("gemma3", "eager")])
def test_token_segments_gathered_into_one_call_equal_each_read_where_it_lies(family, backend, kind, monkeypatch):
    """A layer of several token segments reads them from one buffer with one kernel call while they hold few
    slots; with gathering off (``GATHER_LIMIT`` below any layer) each is its own call and the partials merge:
    the same logits (a 3-token chunk, then single tokens; a sliding-window layer on Gemma 3)."""
    import restkv.cache.layer as layer_module

    model = tiny_model(family, backend)
    replace_for(family)(max_capacity_prompts=24, window_size=8, **GATHERED_CONFIGS[kind])
    input_ids, attention_mask = left_padded([60, 44])
    step = torch.tensor([[7, 9, 11], [5, 6, 8]])
    cache = prefill(model, input_ids, attention_mask)
    probe = Probe(torch.zeros(2, 4, 1, 16), 2, 0, 1.0)
    assert any(isinstance(layer, CompressedLayer) and layer._gathered_widths(probe) is not None
               for layer in cache.layers)
    gathered = decode_in_chunks(model, cache, attention_mask, step)
    monkeypatch.setattr(layer_module, "GATHER_LIMIT", -1)
    apart = decode_in_chunks(model, prefill(model, input_ids, attention_mask), attention_mask, step)
    for ours, theirs in zip(gathered, apart, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


HOSTED_ENTRY_CASES = [(family, backend, SEGMENT_CONFIGS["residual entries"])
                      for family, backend in (("llama", "sdpa"), ("gemma3", "eager"), ("qwen2", "eager"))] + \
    [(family, backend, dict(method="snapkv", residual=True, decode_budget=20, decode_interval=3))
     for family, backend in (("llama", "sdpa"), ("qwen2", "eager"))]  # heads with fewer entries than slots


@pytest.mark.parametrize("family, backend, options", HOSTED_ENTRY_CASES)
def test_residual_entries_read_with_their_host_equal_their_join(family, backend, options, monkeypatch):
    """Entries co-located in the exact tokens' buffer are read in one pass over it (their logits beside the
    exact ones, one softmax); read apart (the exact partial, then the entries joined by log-sum-exp) they give
    the same logits: the gate, the count bias, sliding windows and soft-capping included."""
    from restkv.cache.segments.residual_entries import ResidualEntries

    model = tiny_model(family, backend)
    replace_for(family)(max_capacity_prompts=24, window_size=8, **options)
    input_ids, attention_mask = left_padded([60, 44])
    step = torch.tensor([[7, 9, 11], [5, 6, 8]])
    cache = prefill(model, input_ids, attention_mask)
    assert any(isinstance(layer, CompressedLayer) and layer.summaries and layer.summaries[0].host is layer.tail
               for layer in cache.layers)
    together = decode_in_chunks(model, cache, attention_mask, step)
    monkeypatch.setattr(ResidualEntries, "reads_with_host", lambda self, probe: False)
    apart = decode_in_chunks(model, prefill(model, input_ids, attention_mask), attention_mask, step)
    for ours, theirs in zip(together, apart, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_each_kind_is_the_segment_of_its_part():
    model = tiny_model("llama")
    input_ids, attention_mask = left_padded([60, 44])
    expected = {"dense": DenseTokens, "ragged": RaggedTokens, "pruned keys": PrunedKeyTokens,
                "quantised blocks": QuantizedTokens}
    for kind, segment_type in expected.items():
        replace_for("llama")(max_capacity_prompts=24, window_size=8, **SEGMENT_CONFIGS[kind])
        layer = prefill(model, input_ids, attention_mask).layers[1]
        assert isinstance(layer.kept[0], segment_type), kind


@pytest.mark.parametrize("method", ["snapkv", "adakv"])
def test_a_decode_step_writes_into_the_buffer_it_has(method):
    """Within the tail's capacity a step writes its token in place: the same K/V storage (at least
    ``MIN_SPARE`` tokens of room come with every layer)."""
    model = tiny_model("llama")
    replace_for("llama")(method=method, max_capacity_prompts=24, window_size=8)
    input_ids, attention_mask = left_padded([60, 44])
    cache = prefill(model, input_ids, attention_mask)
    storages = [(layer.tail.keys.data_ptr(), layer.tail.values.data_ptr()) for layer in cache.layers]
    mask = attention_mask
    token = torch.tensor([[7], [5]])
    for step in range(MIN_SPARE):
        mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
        with torch.no_grad():
            model(token, attention_mask=mask, position_ids=mask.sum(dim=-1, keepdim=True) - 1, **with_cache(cache))
        assert [(layer.tail.keys.data_ptr(), layer.tail.values.data_ptr()) for layer in cache.layers] == storages
    assert all(layer.tail_length == MIN_SPARE for layer in cache.layers)


def test_the_tail_grows_and_keeps_its_tokens():
    keys, values = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    for segment in (DenseTokens(keys, values, torch.arange(5).expand(1, 2, -1), capacity=2),
                    RaggedTokens(keys, values, torch.tensor([[[0, 1, 2, -1, -1], [0, 1, 2, 3, 4]]]), capacity=2)):
        appended = []
        for step in range(7):
            new_keys, new_values = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
            segment.append(new_keys, new_values, 5 + step)
            appended.append((new_keys, new_values))
        tail_keys, tail_values, tail_columns = segment.appended_tokens()
        assert torch.equal(tail_keys, torch.cat([k for k, _ in appended], dim=2))
        assert torch.equal(tail_values, torch.cat([v for _, v in appended], dim=2))
        assert tail_columns.tolist() == [[list(range(5, 12))] * 2]
        segment.drop_appended(oldest=2, newest=1)
        assert segment.appended_tokens()[2].tolist() == [[list(range(7, 11))] * 2]


def test_a_fork_shares_nothing_it_writes():
    """``copy.copy`` of a layer (``answer_many``'s snapshot) and the original append apart."""
    import copy

    keys, values = torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4)
    layer = CompressedLayer.from_tokens(keys, values, torch.arange(4).expand(1, 2, -1), tokens_seen=4)
    snapshot = copy.copy(layer)
    layer.append(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))
    snapshot.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    assert bool((layer.kept_tokens(appended=True)[0][:, :, 4] == 1).all())
    assert bool((snapshot.kept_tokens(appended=True)[0][:, :, 4] == 0).all())


def test_ragged_storage_holds_what_each_head_keeps():
    keys, values = torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4)
    columns = torch.tensor([[[0, 2, 4, -1, -1, -1], [0, 1, 2, 3, 4, 5]], [[1, -1, -1, -1, -1, -1], [3, 5, -1, -1, -1, -1]]])
    segment = exact_tokens(keys, values, columns, capacity=0)
    assert isinstance(segment, RaggedTokens) and segment.keys.shape[0] == 3 + 6 + 1 + 2
    padded_keys, _, padded_columns = segment.padded()
    held = columns >= 0
    assert torch.equal(padded_columns, columns.to(torch.int32))
    assert torch.equal(padded_keys[held], keys[held])
    assert segment.nbytes() == (3 + 6 + 1 + 2) * (2 * 4 * 4 + 4) + 2 * 4 * 4  # tokens, columns, int32 counts, starts
    assert math.isclose(segment.report().slots, 12 / 4)
