"""The original release's policies, token for token, through ``restkv.compress_kv``.

On CPU in float32 the kept sets must be identical to the reference's (batch 1, one query
head per KV head, so GQA pooling does not enter).
"""

import pytest
from golden import kept_sets, load_case, reference_kept_sets

from restkv import compress_kv

CASES = {
    "snapkv_avg_k5": dict(method="snapkv", max_capacity_prompts=128, window_size=32, kernel_size=5, pooling="avgpool"),
    # The release keeps the first budget - window tokens plus the window: n_sink = 128 - 32.
    "streamingllm": dict(method="streamingllm", max_capacity_prompts=128, window_size=32, n_sink=96),
    # The case was produced at layer 0 with the release's skip list disabled.
    "l2norm": dict(method="l2norm", max_capacity_prompts=128, l2norm_skip_layers=()),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_kept_sets(name):
    case = load_case(name)
    kept = compress_kv(case["query"], case["key"], case["value"], CASES[name], o_proj_weight=case["o_proj_weight"])
    assert kept.keys.shape == case["key_out"].shape
    assert kept_sets(kept.indices) == reference_kept_sets(case)


def test_golden_streamingllm_default_sinks_differ_from_release_layout():
    """The library default (4 sinks) is StreamingLLM's, not the release's layout."""
    case = load_case("streamingllm")
    kept = compress_kv(case["query"], case["key"], case["value"], dict(method="streamingllm", max_capacity_prompts=128))
    assert kept_sets(kept.indices)[0] == set(range(4)) | set(range(320 - 124, 320))
