"""SimLayerKV: a layer whose last query reads only the sinks and the newest tokens is compressed
(StreamingLLM's tokens), any other keeps every token."""

import pytest
from tiny_models import assert_model_compresses, random_qkv

from restkv import CompressionConfig, compress_kv


@pytest.mark.parametrize("focus, lazy", [(1, True), (62, True), (30, False), (99, False)])
def test_a_layer_is_lazy_when_its_last_query_reads_the_sinks_and_the_newest_tokens(focus, lazy):
    """As kvpress: the newest tokens are the 40 - 4 + 1 = 37 before the last query, 62..98; its own key is
    not one of them (it was counted, the window ending at 99)."""
    query, key, value = random_qkv(length=100, seed=51)
    key = key * 0.1
    key[0, :, focus] = query[0, ::2, -1] * 3.0  # the last query of each group's first head finds this key
    out = compress_kv(query, key, value, dict(method="simlayerkv", max_capacity_prompts=40, simlayer_threshold=0.5))
    kept = [set(i for i in out.indices[0, head].tolist() if i >= 0) for head in range(2)]
    if lazy:
        assert kept == [set(range(4)) | set(range(64, 100))] * 2
    else:
        assert kept == [set(range(100))] * 2


def test_simlayerkv_compresses_a_model_and_its_options_are_the_allocations():
    config = CompressionConfig(method="simlayerkv", max_capacity_prompts=30, simlayer_threshold=0.2)
    assert config.run.allocation == "simlayer" and config.allocator.simlayer_threshold == 0.2
    assert_model_compresses(dict(method="simlayerkv", max_capacity_prompts=30, simlayer_threshold=0.0))
