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
from tiny_models import random_prompt, random_qkv, tiny_model

from restkv import CompressionConfig, ConfigError, available_methods, compress_kv
from restkv.config.flags import add_compression_flags, config_from_flags
from restkv.config.options import unregister
from restkv.integrations.transformers.compat import output_cache
from restkv.integrations.transformers.patching import replace_llama

METHOD_FILE = '''
"""KeyNorm^p: keeps the tokens whose keys have the smallest norm, raised to a power."""

from dataclasses import dataclass

from restkv.config.options import option, register
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

from restkv.allocations.base import Allocation
from restkv.config.options import option, register


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


def installed(tmp_path, kind: str, name: str, source: str):
    """Load ``source`` as module ``name`` (it registers a ``kind`` part), yield its name, then
    unregister it: a fixture's body."""
    load_module(tmp_path, name, source)
    yield name
    unregister(kind, name)
    sys.modules.pop(name)


@pytest.fixture
def keynorm_method(tmp_path):
    yield from installed(tmp_path, "method", "keynorm_power", METHOD_FILE)


@pytest.fixture
def front_loaded(tmp_path):
    yield from installed(tmp_path, "allocation", "front_loaded", ALLOCATION_FILE)


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


SEGMENT_FILE = '''
"""Mean summary: the evicted tokens of each head kept as one entry, their mean key and value."""

from dataclasses import dataclass

import torch

from restkv.config.options import Options, register
from restkv.cache.partial import Partial, merge, scaled_logits
from restkv.scoring.selection import Reservation
from restkv.cache.segments.base import SegmentReport, tensor_bytes


@register("switch")
@dataclass(frozen=True)
class MeanSummary(Options):
    name = "mean_summary"
    switch_help = "keep the evicted tokens of each head as one entry (their mean key and value)"

    def reserve(self, ctx, scores, keep, previous=()):
        evicts = keep < ctx.visible.sum(dim=-1)[:, None]
        return Reservation(scores, torch.where(evicts, keep - 1, keep))  # the entry takes one slot

    def summarise(self, ctx, columns, memo):
        kept = torch.zeros(*ctx.key.shape[:3], dtype=torch.bool).scatter_(2, columns.clamp(min=0), columns >= 0)
        evicted = (ctx.visible[:, None, :] & ~kept).float()[..., None]
        count = evicted.sum(dim=2)  # [B, H_kv, 1]
        mean = lambda x: (x * evicted).sum(dim=2) / count.clamp(min=1)
        return [MeanEntry(mean(ctx.key), mean(ctx.value), count[..., 0].log())]


class MeanEntry:
    kind = "mean entry"
    needs_peak = needs_count = False

    def __init__(self, key, value, log_count):
        self.key, self.value, self.log_count = key, value, log_count  # [B, H_kv, d], [B, H_kv]

    def join(self, current, exact, probe):
        lse = scaled_logits(probe, self.key[:, :, None])[..., 0] + self.log_count[..., None]
        return merge([current, Partial(self.value[:, :, None].expand(*lse.shape, -1), lse)], statistics=False)

    def counts(self):
        return torch.isfinite(self.log_count).long()

    budget_slots = counts

    def report(self):
        return SegmentReport(self.kind, None, float(self.counts().float().mean()), tensor_bytes(self.tensors()))

    def tensors(self):
        return [self.key, self.value, self.log_count]

    def as_slots(self):
        return self.key[:, :, None], self.value[:, :, None], self.log_count[..., None], None, None

    def fork(self):
        return self

    def map_batch(self, fn):
        return MeanEntry(fn(self.key), fn(self.value), fn(self.log_count))
'''


@pytest.fixture
def mean_summary(tmp_path):
    yield from installed(tmp_path, "switch", "mean_summary", SEGMENT_FILE)


def test_a_new_segment_file_is_a_switch_whose_segment_decode_reads(mean_summary):
    """The part reserves one slot for its entry, builds it from what the layer evicts, and the
    layer reads it in the same softmax as the exact tokens."""
    from restkv.cache.partial import Probe

    model = tiny_model("llama")
    replace_llama(method="snapkv", max_capacity_prompts=16, window_size=4, mean_summary=True)
    generated = model.generate(random_prompt(1, 50), max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    layer = output_cache(generated).layers[0]
    entry = layer.summaries[0]
    assert type(entry).__name__ == "MeanEntry" and layer.kept_counts.tolist() == [[15, 15]]
    assert entry.log_count.exp().round().tolist() == [[50 - 15] * 2]
    assert [report.kind for report in layer.reports()] == ["exact dense", "mean entry"]
    query = torch.randn(1, 4, 1, 16)
    ours = layer.read(Probe(query, 2, layer.tokens_seen, 0.25))
    keys, values, _ = layer.kept_tokens(appended=True)
    every_key = torch.cat([keys, entry.key[:, :, None]], dim=2).repeat_interleave(2, dim=1)
    every_value = torch.cat([values, entry.value[:, :, None]], dim=2).repeat_interleave(2, dim=1)
    logits = query @ every_key.transpose(-1, -2) * 0.25
    logits[..., -1] += entry.log_count.repeat_interleave(2, dim=1)[..., None]
    expected = torch.softmax(logits, dim=-1) @ every_value
    torch.testing.assert_close(ours, expected.transpose(1, 2), rtol=1e-5, atol=1e-6)
