"""DMS-style threshold eviction (--dms): what reaches the threshold stays, at most the budget."""

import pytest
import torch
from tiny_models import assert_model_compresses, random_qkv

from restkv import CompressionConfig, ConfigError, compress_kv
from restkv.pipeline.inputs import LayerInputs
from restkv.pipeline.plan import plan_layer, valid_from_mask


@pytest.mark.parametrize("budget", [90, 30])
def test_the_window_and_every_token_reaching_the_threshold_stay_up_to_the_budget(budget):
    query, key, value = random_qkv(length=100, seed=31)
    options = dict(method="snapkv", max_capacity_prompts=budget, window_size=8)
    config = CompressionConfig(**options)
    ctx = LayerInputs(query, key, value, plan_layer(config, valid_from_mask(None, 1, 100, key.device)))
    scores = config.policy.score(ctx)[0]
    threshold = float(scores[:, :92].median())
    out = compress_kv(query, key, value, dict(options, dms=True, dms_threshold=threshold))
    for head in range(2):
        reaching = [int(i) for i in torch.argsort(scores[head, :92], descending=True, stable=True)
                    if scores[head, i] >= threshold][: budget - 8]
        assert set(i for i in out.indices[0, head].tolist() if i >= 0) == set(reaching) | set(range(92, 100))
    counts = (out.indices >= 0).sum(dim=-1)[0].tolist()
    assert max(counts) < budget if budget == 90 else max(counts) == budget  # the threshold binds, then the budget


def test_a_padded_row_within_its_budget_is_kept_whole_as_it_is_alone():
    """A batch compresses for its longer row; the shorter one fits the budget and keeps every token, as alone
    (the threshold once thinned it)."""
    query, key, value = random_qkv(batch=2, length=100, seed=32)
    mask = torch.ones(2, 100, dtype=torch.long)
    mask[1, :40] = 0
    options = dict(method="l2norm", l2norm_skip_layers=(), max_capacity_prompts=80, window_size=0, dms=True,
                   dms_threshold=-8.0)
    out = compress_kv(query, key, value, options, attention_mask=mask)
    alone = compress_kv(query[1:, :, 40:], key[1:, :, 40:], value[1:, :, 40:], options)
    assert (out.indices[1] >= 0).sum(dim=-1).tolist() == (alone.indices[0] >= 0).sum(dim=-1).tolist() == [60, 60]
    assert (out.indices[0] >= 0).sum(dim=-1).max() < 80  # the long row is thresholded

def test_dms_needs_a_threshold_and_a_scorer():
    with pytest.raises(ConfigError, match="give --dms_threshold"):
        CompressionConfig(method="snapkv", max_capacity_prompts=40, dms=True)
    with pytest.raises(ConfigError, match="--method streamingllm keeps tokens by position"):
        CompressionConfig(method="streamingllm", max_capacity_prompts=40, dms=True, dms_threshold=0.1)


@pytest.mark.parametrize("extra", [dict(), dict(method="kvzip", dms_threshold=0.01), dict(allocation="adakv"),
                                   dict(prefill_chunk_size=32), dict(quant_method="kivi", nbits=4)])
def test_dms_compresses_a_model_with_the_other_parts(extra):
    assert_model_compresses({"method": "snapkv", "max_capacity_prompts": 40, "window_size": 8, "dms": True,
                             "dms_threshold": 0.05, **extra})
