"""Parts given as values (``policy=SnapKV(...)``, ``allocation=AdaKVAllocation()``, ``switches=[...]``) are the
same config as the same parts named by the release's flat flags, and give bit-identical caches; a part of the
wrong kind, or two values for one flag, are refused in one line."""

import pytest
import torch
from tiny_models import random_prompt, tiny_model

import restkv
from restkv import CompressionConfig, ConfigError
from restkv.allocations import AdaKVAllocation, Pyramid
from restkv.integrations.transformers.compat import output_cache
from restkv.integrations.transformers.patching import config_of, replace_for_model
from restkv.merges import PivotMerge
from restkv.policies import H2O, MomentKV, RestKV, SimLayerKV, SnapKV, StreamingLLM
from restkv.quantizers import KIVI
from restkv.switches import CriticalRescoring, KeyChannelPruning, ResidualCache

#: (parts as values, the same parts as flags), the budget given flat to both
COMPOSITIONS = {
    "snapkv+adakv+critical+residual": (
        dict(policy=SnapKV(kernel_size=7), allocation=AdaKVAllocation(), switches=[CriticalRescoring(), ResidualCache()]),
        dict(method="snapkv", kernel_size=7, allocation="adakv", critical=True, residual=True),
    ),
    "restkv+pyramid": (
        dict(policy=RestKV(alpha=0.3, pooling="maxpool"), allocation=Pyramid),
        dict(method="restkv", alpha=0.3, pooling="maxpool", allocation="pyramid"),
    ),
    "h2o+pivot+kivi": (
        dict(policy=H2O(), merge=PivotMerge(), quantizer=KIVI(nbits=4, quant_group_size=8, quant_residual_length=8)),
        dict(method="h2o", merge="pivot", quant_method="kivi", nbits=4, quant_group_size=8, quant_residual_length=8),
    ),
    "momentkv": (dict(policy=MomentKV()), dict(method="momentkv")),
    "streamingllm+think": (
        dict(policy=StreamingLLM(n_sink=2), switches=[KeyChannelPruning(pruning_ratio=0.5)]),
        dict(method="streamingllm", n_sink=2, think=True, pruning_ratio=0.5),
    ),
}


def cache_tensors(cache) -> list[tuple[str, torch.Tensor]]:
    """Every tensor every segment of every layer holds, named by its layer and segment kind."""
    return [(f"layer {index} {type(segment).__name__}", tensor)
            for index, layer in enumerate(cache.layers)
            for segment in (*layer.kept, *layer.summaries, *layer.corrections) for tensor in segment.tensors()]


def generate(model, config_or_options: dict):
    with restkv.compression(model, **config_or_options):
        return model.generate(random_prompt(1, 60), max_new_tokens=4, do_sample=False, return_dict_in_generate=True)


@pytest.mark.parametrize("name", COMPOSITIONS)
def test_parts_as_values_are_the_config_the_flags_name_and_give_the_same_cache(name):
    values, flags = COMPOSITIONS[name]
    budget = dict(max_capacity_prompts=24, window_size=4)
    assert CompressionConfig(**values, **budget) == CompressionConfig(**flags, **budget)
    model = tiny_model("llama")
    by_values, by_flags = generate(model, {**values, **budget}), generate(model, {**flags, **budget})
    assert torch.equal(by_values.sequences, by_flags.sequences)
    ours, theirs = cache_tensors(output_cache(by_values)), cache_tensors(output_cache(by_flags))
    assert [label for label, _ in ours] == [label for label, _ in theirs]
    for (label, a), (_, b) in zip(ours, theirs):
        assert torch.equal(a, b), label


def test_every_entry_point_takes_parts_as_values_and_a_config_passes_through_unbuilt():
    model = tiny_model("llama")
    config = CompressionConfig(policy=SnapKV(), compression_ratio=0.5)
    assert replace_for_model(model, config) is config and config_of(model) is config
    given = replace_for_model(model, policy=H2O(), switches=[ResidualCache(residual_iters=2)], compression_ratio=0.5)
    assert given == CompressionConfig(method="h2o", residual=True, residual_iters=2, compression_ratio=0.5)
    assert config.replace(policy=SnapKV(kernel_size=3)).kernel_size == 3
    # a part given as a value brings all its options: none kept from before
    assert config.replace(kernel_size=3).replace(policy=SnapKV()).kernel_size == SnapKV().kernel_size


@pytest.mark.parametrize("options, message", [
    (dict(policy=AdaKVAllocation()), r"policy= takes a method .*AdaKVAllocation is a registered allocation"),
    (dict(policy="snapkv"), r"policy= takes a method part .*use method='snapkv'"),
    (dict(quantizer="kivi"), r"quantizer= takes a quantisation part .*use quant_method='kivi'"),
    (dict(method="h2o", policy=SnapKV()), r"policy= gives the method 'snapkv' and method='h2o' another"),
    (dict(switches=ResidualCache()), r"switches= takes a list of switch parts"),
    (dict(switches=[SnapKV()]), r"switches= takes a switch .*SnapKV is a registered method"),
    (dict(switches=[ResidualCache(), ResidualCache()]), r"switches= gives the residual switch twice"),
    (dict(switches=[ResidualCache()], residual=False), r"give one"),
    (dict(policy=SnapKV(kernel_size=7), kernel_size=3), r"kernel_size is 7 in SnapKV \(policy\) and 3 elsewhere"),
    # SimLayerKV's method and its allocation share --n_sink: one flag, one value
    (dict(policy=SimLayerKV(), allocation=__import__("restkv.allocations").allocations.SimLayerAllocation(n_sink=8)),
     r"SimLayerKV \(policy\) runs with n_sink=8, not the n_sink=4"),
])
def test_a_part_of_the_wrong_kind_or_two_values_for_one_flag_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        CompressionConfig(compression_ratio=0.5, **options)


def test_a_folder_names_its_parts_by_class_and_nothing_else():
    from restkv import switches

    assert switches.ResidualCache is ResidualCache
    with pytest.raises(AttributeError, match="its switch parts: .*ResidualCache"):
        switches.Residual
