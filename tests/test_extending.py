"""Adding a method or an allocation is one new file: docs/ARCHITECTURE.md's worked examples, run.

Each example is written to a temporary module exactly as a contributor would write it in
``restkv/policies/`` (or next to ``restkv/allocation.py``), imported, and then used through
every entry point without any other edit: ``compress_kv``, ``replace_llama`` + ``generate``,
the runners' flag parser and its error messages.
"""

import argparse
import importlib.util
import sys
import textwrap

import pytest
import torch

from restkv import CompressionConfig, ConfigError, available_methods, compress_kv
from restkv.compat import output_cache
from restkv.flags import add_compression_flags, config_from_flags
from restkv.monkeypatch import replace_llama
from restkv.options import unregister
from tiny_models import random_prompt, random_qkv, tiny_model

METHOD_FILE = '''
"""KeyNorm^p: keeps the tokens whose keys have the smallest norm, raised to a power."""

from dataclasses import dataclass

from restkv.options import option, register
from restkv.policies import Policy


@register("method")
@dataclass(frozen=True)
class KeyNormPower(Policy):
    name = "keynorm_power"

    keynorm_exponent: float = option(1.0, "exponent applied to the key norm", minimum=0, exclusive_minimum=True)

    def score(self, ctx):
        return -ctx.key.float().norm(dim=-1) ** self.keynorm_exponent
'''

ALLOCATION_FILE = '''
"""Front-loaded: the first half of the layers keep more tokens than the second half."""

from dataclasses import dataclass

import torch

from restkv.allocation import Allocation
from restkv.options import option, register


@register("allocation")
@dataclass(frozen=True)
class FrontLoaded(Allocation):
    name = "front_loaded"

    front_share: float = option(0.75, "share of the candidate budget the first half of the layers adds", minimum=0,
                                maximum=1)

    def candidate_counts(self, layer, scores, shape, available):
        extra = int(self.front_share * shape.candidate_budget)
        first_half = layer.layer_idx < layer.num_layers // 2
        return torch.clamp(available, max=shape.candidate_budget + (extra if first_half else -extra))
'''


def load_module(tmp_path, name: str, source: str):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def keynorm_method(tmp_path):
    load_module(tmp_path, "keynorm_power", METHOD_FILE)
    yield "keynorm_power"
    unregister("method", "keynorm_power")
    sys.modules.pop("keynorm_power")


@pytest.fixture
def front_loaded(tmp_path):
    load_module(tmp_path, "front_loaded", ALLOCATION_FILE)
    yield "front_loaded"
    unregister("allocation", "front_loaded")
    sys.modules.pop("front_loaded")


def test_a_new_method_file_is_a_method_everywhere(keynorm_method):
    assert keynorm_method in available_methods()
    query, key, value = random_qkv(length=64)
    out = compress_kv(query, key, value, dict(method=keynorm_method, max_capacity_prompts=20, window_size=4,
                                              keynorm_exponent=2.0))
    for head in range(2):
        past = sorted(torch.topk(-key[0, head, :60].norm(dim=-1), 16).indices.tolist())
        assert out.indices[0, head].tolist() == past + [60, 61, 62, 63]

    replace_llama(method=keynorm_method, max_capacity_prompts=16, window_size=4, keynorm_exponent=0.5)
    generated = tiny_model("llama").generate(random_prompt(1, 50), max_new_tokens=2, do_sample=False,
                                             return_dict_in_generate=True)
    assert output_cache(generated).layers[0].kept_counts.max() == 16

    parser = argparse.ArgumentParser()
    add_compression_flags(parser)
    flags = f"--method {keynorm_method} --max_capacity_prompts 48 --keynorm_exponent 3".split()
    assert config_from_flags(parser.parse_args(flags)).keynorm_exponent == 3.0
    with pytest.raises(ConfigError, match="--keynorm_exponent must be > 0; got 0.0"):
        config_from_flags(parser.parse_args([*flags[:-1], "0"]))
    with pytest.raises(SystemExit):  # not a number: argparse names the flag
        parser.parse_args([*flags[:-1], "high"])


def test_a_new_allocation_file_composes_with_every_scorer(front_loaded):
    query, key, value = random_qkv(length=96)
    kept = []
    for layer in range(4):
        config = CompressionConfig(method="snapkv", allocation=front_loaded, max_capacity_prompts=24,
                                   window_size=8, front_share=0.5)
        out = compress_kv(query, key, value, config, layer_idx=layer, num_layers=4)
        kept.append(int((out.indices[0, 0] >= 0).sum()))
    assert kept == [32, 32, 16, 16]  # 16 candidates +- 8, plus the window of 8
    with pytest.raises(ConfigError, match=r"--front_share must lie in \[0, 1\]"):
        CompressionConfig(method="h2o", allocation=front_loaded, max_capacity_prompts=24, front_share=2.0)
