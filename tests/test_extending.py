"""Adding a method, an allocation, a scorer of hidden states, a summary segment or a stored token kind is one
new file: docs/ARCHITECTURE.md's worked examples, run.

Each example is written to a temporary module exactly as a contributor would write it in
``restkv/policies/`` (or ``restkv/allocations/``, ``restkv/switches/``), imported, and then used through
every entry point without any other edit: ``compress_kv``, ``replace_llama`` + ``generate``,
the runners' flag parser and its error messages.
"""

import argparse
import functools
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


HIDDEN_SCORER_FILE = '''
"""Hidden norm: keeps the tokens whose attention input (after the layer's input norm) is largest."""

from dataclasses import dataclass

from restkv.config.options import register
from restkv.policies import Policy


@register("method")
@dataclass(frozen=True)
class HiddenNorm(Policy):
    name = "hidden_norm"
    needs_hidden_states = True  # a layer waiting for the whole prefill keeps them for it
    observes_queries = False

    def score(self, ctx):
        return ctx.hidden.float().norm(dim=-1)[:, None, :].expand(-1, ctx.num_kv_heads, -1)
'''


@pytest.fixture
def hidden_norm(tmp_path):
    yield from installed(tmp_path, "method", "hidden_norm", HIDDEN_SCORER_FILE)


def attention_inputs(model) -> dict[int, torch.Tensor]:
    """The hidden states each attention layer of ``model`` is called with, captured by its next forward."""
    seen = {}

    def keep(index, module, args, kwargs):
        seen.setdefault(index, kwargs["hidden_states"])

    for index, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(functools.partial(keep, index), with_kwargs=True)
    return seen


@pytest.mark.parametrize("allocation", ["uniform", "model_ranked"])
def test_a_scorer_of_hidden_states_is_one_file(hidden_norm, allocation):
    """The scorer reads ``ctx.hidden`` and nothing else is edited: at the prefill (uniform budgets) and after the whole
    prefill (a model-wide ranking, whose layers wait with their hidden states), each head keeps the window and the
    tokens of largest hidden norm before it; ``compress_kv`` takes the hidden states as an argument."""
    model = tiny_model("llama")
    seen = attention_inputs(model)
    prompt, budget, window = random_prompt(1, 50), 16, 4
    replace_llama(method=hidden_norm, max_capacity_prompts=budget, window_size=window, allocation=allocation)
    generated = model.generate(prompt, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
    cache = output_cache(generated)
    for index, layer in enumerate(cache.layers):
        norms = seen[index][0, : 50 - window].float().norm(dim=-1)
        for head, count in enumerate(layer.kept_counts[0].tolist()):
            kept = layer.kept_columns[0, head][: count].tolist()
            assert kept[-window:] == list(range(50 - window, 50))
            assert kept[:-window] == sorted(torch.topk(norms, count - window).indices.tolist()), (index, head)
    query, key, value = random_qkv(length=40)
    hidden = torch.randn(1, 40, 64)
    out = compress_kv(query, key, value, dict(method=hidden_norm, max_capacity_prompts=10, window_size=2),
                      hidden_states=hidden)
    assert out.indices[0, 0].tolist() == sorted(torch.topk(hidden[0, :38].norm(dim=-1), 8).indices.tolist()) + [38, 39]


LOW_RANK_FILE = '''
"""Low-rank keys: each head's older kept keys held as coefficients on their top singular directions."""

import dataclasses
from dataclasses import dataclass

import torch

from restkv.config.options import Options, option, register
from restkv.cache.segments.base import tensor_bytes


@register("switch")
@dataclass(frozen=True)
class LowRankKeyStorage(Options):
    name = "lowrank_keys"
    switch_help = "hold each head's older kept keys as --lowrank_rank coefficients on their top singular directions"

    lowrank_rank: int = option(8, "--lowrank_keys: the rank each head's older keys keep", minimum=1)

    def exact_recent_tokens(self, config):
        return config.run.window_size

    def storing(self, ctx, keys, columns):
        return self.low_rank

    def low_rank(self, keys, values, columns, inner):
        basis = torch.linalg.svd(keys.float(), full_matrices=False).Vh[..., : self.lowrank_rank, :].to(keys.dtype)
        return LowRankKeys(inner(keys @ basis.transpose(-1, -2), values, columns), basis)


class LowRankKeys:
    """Tokens whose keys are coefficients (the ``inner`` segment's keys) on a basis ``[B, H_kv, r, d]``."""

    def __init__(self, inner, basis):
        self.inner, self.basis = inner, basis
        self.kind = self.storage = f"keys rank {basis.shape[-2]}/{basis.shape[-1]}"

    def attend(self, probe):
        return self.inner.attend(probe.with_queries(probe.stacked @ self.basis.transpose(-1, -2)))

    def padded(self, appended=True):
        coefficients, values, columns = self.inner.padded(appended)
        return coefficients @ self.basis, values, columns

    def kept_counts(self):
        return self.inner.kept_counts()

    def held_counts(self):
        return self.inner.held_counts()

    def report(self):
        inner, basis = self.inner.report(), tensor_bytes([self.basis])
        return dataclasses.replace(inner, kind=self.kind, nbytes=inner.nbytes + basis,
                                   used_nbytes=inner.used_nbytes + basis)

    def tensors(self):
        return [*self.inner.tensors(), self.basis]

    def fork(self):
        return self

    def map_batch(self, fn):
        return LowRankKeys(self.inner.map_batch(fn), fn(self.basis))
'''


@pytest.fixture
def low_rank_keys(tmp_path):
    yield from installed(tmp_path, "switch", "lowrank_keys", LOW_RANK_FILE)


def test_a_new_stored_token_kind_is_one_file(low_rank_keys):
    """A storage part and its segment, in one file: the older kept keys are held at rank 4 of 16 (fewer bytes), the
    window whole in the tail; decode reads them in the same softmax as the rest; at full rank it is the exact cache."""
    from restkv.cache.partial import Probe

    prompt = random_prompt(1, 60)
    replace_llama(method="snapkv", max_capacity_prompts=24, window_size=4, lowrank_keys=True, lowrank_rank=4)
    layer = output_cache(tiny_model("llama").generate(prompt, max_new_tokens=3, do_sample=False,
                                                      return_dict_in_generate=True)).layers[0]
    low_rank, tail = layer.kept
    assert [report.kind for report in layer.reports()] == ["keys rank 4/16", "exact dense"]
    assert low_rank.kept_counts().tolist() == [[20, 20]] and tail.held_counts().tolist() == [[4 + 2, 4 + 2]]  # the last new token is not fed
    assert low_rank.report().used_nbytes < tail.report().used_nbytes / 6 * 20
    query = torch.randn(1, 4, 1, 16)
    keys, values, _ = layer.kept_tokens(appended=True)
    expected = torch.softmax(query @ keys.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.25, dim=-1)
    expected = expected @ values.repeat_interleave(2, dim=1)
    ours = layer.read(Probe(query, 2, layer.tokens_seen, 0.25))
    torch.testing.assert_close(ours, expected.transpose(1, 2), rtol=1e-5, atol=1e-6)

    runs = []
    for switch in ({}, dict(lowrank_keys=True, lowrank_rank=16)):
        replace_llama(method="snapkv", max_capacity_prompts=24, window_size=4, **switch)
        runs.append(tiny_model("llama").generate(prompt, max_new_tokens=6, do_sample=False, output_logits=True,
                                                 return_dict_in_generate=True))
    exact, full_rank = runs
    assert torch.equal(exact.sequences, full_rank.sequences)
    torch.testing.assert_close(torch.stack(full_rank.logits), torch.stack(exact.logits), rtol=1e-4, atol=1e-4)


def test_a_segment_that_does_not_implement_its_role_is_refused_by_name():
    from restkv.cache.layer import CompressedLayer

    class HalfEntry:
        kind = "half"

        def join(self, current, exact, probe):
            return current

    keys = torch.zeros(1, 2, 3, 16)
    with pytest.raises(TypeError, match="a summary HalfEntry is not a SummarySegment: it lacks as_slots, budget_slots, "
                                        "counts, fork, map_batch, needs_count, needs_peak, report, tensors"):
        CompressedLayer.from_tokens(keys, keys, torch.zeros(1, 2, 3, dtype=torch.int32), 3, summaries=[HalfEntry()])
