"""Two evicting scorers in a chain (--prefilter METHOD --prefilter_ratio R, kvpress' ComposedPress): the
prefilter keeps floor(N (1 - R)) of the prompt, --method ranks only those to the run's budget."""

import pytest
import torch
from tiny_models import assert_model_compresses, random_qkv

from restkv import CompressionConfig, ConfigError, compress_kv
from restkv.pipeline.inputs import LayerInputs
from restkv.pipeline.plan import plan_layer

LENGTH, WINDOW = 96, 8


def kept(config: CompressionConfig, qkv) -> list[set[int]]:
    """Per KV head, the positions ``compress_kv`` keeps."""
    return [set(i for i in head.tolist() if i >= 0) for head in compress_kv(*qkv, config).indices[0]]


@pytest.mark.parametrize("prefilter, method", [("snapkv", "l2norm"), ("l2norm", "snapkv"), ("h2o", "snapkv")])
def test_the_method_keeps_its_best_among_what_the_prefilter_keeps(prefilter, method):
    qkv = random_qkv(length=LENGTH)
    shared = dict(window_size=WINDOW, l2norm_skip_layers=(), l2norm_protect_window=True)
    first = kept(CompressionConfig(method=prefilter, compression_ratio=0.4, **shared), qkv)
    second = CompressionConfig(method=method, compression_ratio=0.75, **shared)
    composed = kept(CompressionConfig(method=method, compression_ratio=0.75, prefilter=prefilter, prefilter_ratio=0.4,
                                      **shared), qkv)
    plan = plan_layer(second, torch.ones(1, LENGTH, dtype=torch.bool))
    scores = second.policy.score(LayerInputs(*qkv, plan))[0]  # the method's scores of the whole prompt
    for head, (survivors, chosen) in enumerate(zip(first, composed)):
        assert len(survivors) == 57 and len(chosen) == 24 and chosen <= survivors
        window = set(range(LENGTH - WINDOW, LENGTH))
        ranked = sorted(survivors - window, key=lambda p: (-float(scores[head, p]), p))
        assert chosen == window | set(ranked[: 24 - WINDOW])


def test_a_budget_above_what_the_prefilter_keeps_keeps_exactly_that():
    qkv = random_qkv(length=LENGTH)
    first = kept(CompressionConfig(method="snapkv", compression_ratio=0.6, window_size=WINDOW), qkv)
    composed = kept(CompressionConfig(method="l2norm", max_capacity_prompts=80, window_size=WINDOW,
                                      prefilter="snapkv", prefilter_ratio=0.6, l2norm_skip_layers=()), qkv)
    assert composed == first


@pytest.mark.parametrize("extra", [dict(residual=True), dict(allocation="adakv"), dict(think=True),
                                   dict(decode_budget=40, decode_interval=4)])
def test_a_prefilter_composes_with_the_other_parts(extra):
    assert_model_compresses(dict(method="snapkv", max_capacity_prompts=30, window_size=8, prefilter="l2norm",
                                 prefilter_ratio=0.3, l2norm_skip_layers=(), **extra))


@pytest.mark.parametrize("options, fragment", [
    (dict(prefilter="snapkv"), "--prefilter snapkv keeps a share of the prompt: give --prefilter_ratio R"),
    (dict(prefilter="snapkv", prefilter_ratio=1.0), "--prefilter_ratio must lie in \\[0, 1\\)"),
    (dict(prefilter="fullkv", prefilter_ratio=0.5), "--prefilter fullkv evicts nothing"),
    (dict(prefilter="nope", prefilter_ratio=0.5), "--prefilter 'nope' is not a known method"),
    (dict(prefilter="snapkv", prefilter_ratio=0.5, prefill_chunk_size=32), "ranks the whole prompt once"),
    (dict(prefilter="kvzip", prefilter_ratio=0.5), "--prefilter kvzip scores by the model repeating the prompt"),
])
def test_a_prefilter_that_cannot_rank_the_prompt_first_is_refused_in_one_line(options, fragment):
    with pytest.raises(ConfigError, match=fragment):
        CompressionConfig(method="snapkv", compression_ratio=0.5, window_size=8, **options)


def test_a_prefilter_ratio_without_a_prefilter_is_ignored_with_a_warning():
    with pytest.warns(UserWarning, match="--prefilter_ratio not used"):
        config = CompressionConfig(method="snapkv", compression_ratio=0.5, prefilter_ratio=0.3)
    assert config.prefilter is None
