"""RestoreKV's segment: restore tokens read as ordinary entries of one softmax, whatever the layer beside them."""

import pytest
import torch
from transformers import DynamicCache

from restkv.cache import CompressedLayer, cache_report
from restkv.cache.partial import use_kernel
from restkv.cache.segments.restore_tokens import RestoreTokens
from restkv.pipeline.compress import LayerState, public_view

CPU_KERNELS = ["reference", "sdpa"]


def tensors(seed: int, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def oracle(query, keys, values, scaling):
    """The softmax of ``query`` ``[B, H, q, d]`` over ``keys``/``values`` ``[B, H_kv, S, d]``, the last ``q`` keys
    (the step's own tokens) causal among the queries."""
    groups = query.shape[1] // keys.shape[1]
    logits = query @ keys.repeat_interleave(groups, dim=1).transpose(-1, -2) * scaling
    rows, total = query.shape[2], keys.shape[2]
    future = torch.ones(rows, rows, dtype=torch.bool).triu(1)
    mask = torch.zeros(rows, total, dtype=torch.bool)
    mask[:, total - rows:] = future
    weights = torch.softmax(logits.masked_fill(mask, float("-inf")), dim=-1)
    return (weights @ values.repeat_interleave(groups, dim=1)).transpose(1, 2)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("ragged", [False, True])
def test_a_read_equals_attention_over_the_kept_restore_and_new_tokens_concatenated(kernel, ragged):
    kept_keys, kept_values = tensors(0, 1, 2, 20, 8), tensors(1, 1, 2, 20, 8)
    columns = torch.arange(20).expand(1, 2, -1).clone().int()
    if ragged:  # head 1 kept fewer tokens: its last slots are holes
        columns[0, 1, 15:] = -1
    restore = RestoreTokens(tensors(2, 1, 2, 4, 8), tensors(3, 1, 2, 4, 8))
    layer = CompressedLayer.from_tokens(kept_keys, kept_values, columns, tokens_seen=30, summaries=[restore])
    query, new_keys, new_values = tensors(4, 1, 4, 3, 8), tensors(5, 1, 2, 3, 8), tensors(6, 1, 2, 3, 8)
    with use_kernel(kernel):
        output = layer.attend(query, new_keys, new_values, None, scaling=0.3)
    for head in range(2):
        held = columns[0, head] >= 0
        keys = torch.cat([kept_keys[:, head:head + 1, held], restore.keys[:, head:head + 1],
                          new_keys[:, head:head + 1]], dim=2)
        values = torch.cat([kept_values[:, head:head + 1, held], restore.values[:, head:head + 1],
                            new_values[:, head:head + 1]], dim=2)
        expected = oracle(query[:, 2 * head:2 * head + 2], keys, values, 0.3)
        torch.testing.assert_close(output[:, :, 2 * head:2 * head + 2], expected, rtol=1e-5, atol=1e-5)


def test_the_report_names_the_kind_its_slots_and_bytes():
    restore = RestoreTokens(tensors(2, 1, 2, 8, 16), tensors(3, 1, 2, 8, 16))
    layer = CompressedLayer.from_tokens(tensors(0, 1, 2, 20, 16), tensors(1, 1, 2, 20, 16),
                                        torch.arange(20).expand(1, 2, -1).int(), tokens_seen=40, summaries=[restore])
    cache = DynamicCache()
    cache.layers = [layer]
    segments = {segment.kind: segment for segment in cache_report(cache)[0].segments}
    report = segments["restore tokens"]
    assert report.slots == 8.0 and report.tokens is None and report.nbytes == 2 * 1 * 2 * 8 * 16 * 4
    assert restore.budget_slots().tolist() == [[8, 8]]


def test_compress_kv_shows_the_restore_tokens_in_the_last_slots_as_entries_of_count_one():
    keys, values = tensors(0, 1, 2, 10, 4), tensors(1, 1, 2, 10, 4)
    kept = CompressedLayer.from_tokens(keys, values, torch.arange(10).expand(1, 2, -1).int(), 10).kept
    restore = RestoreTokens(tensors(2, 1, 2, 3, 4), tensors(3, 1, 2, 3, 4))
    view = public_view(LayerState(kept, [restore]), torch.zeros(1, dtype=torch.long))
    assert view.keys.shape[2] == 13 and torch.equal(view.keys[:, :, 10:], restore.keys)
    assert view.indices[0, 0, 10:].tolist() == [-1, -1, -1] and view.residual_log_counts.eq(0).all()
