"""kvpress 0.5.5's presses while decoding, step for step: the fixtures in ``data/fixtures/golden_kvpress_decoding``.

The fixtures' tiny Llama prefills their 384-token prompt, then reads 64 fixed tokens one at a time; after every
step the positions each layer and KV head holds are compared with what kvpress held (its ``kept`` array; where a
tie at layer 0 made kvpress keep the higher of two equal scores, ``kept_tiebreak_low`` is the set restkv, which
breaks ties towards the lower position, must hold). The folder's README says how the fixtures were made and which
kvpress behaviours restkv follows or leaves (``DecodingPress`` over SnapKV or Expected Attention rotates every
buffered query to the newest position, which restkv does not: those cases are recorded, not mapped here).

``ComposedPress`` chains are prefill cases: ``--prefilter snapkv --prefilter_ratio 0.3`` then ``--method l2norm``
reproduces ``[SnapKV(0.3), Knorm(0.4)]``. The other two chains are recorded, not mapped: kvpress' second press
reads the first press's output in its score order, so SnapKV after Knorm takes the 64 lowest-norm rows as its
window, and Expected Attention after StreamingLLM takes the first four rows StreamingLLM's tied scores left as its
sinks; restkv's second method sees the prompt's positions (its window is the newest tokens, kept by the prefilter).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from test_kvpress_parity import FIXTURES as PREFILL_FIXTURES
from test_kvpress_parity import prompt, tiny_llama

import restkv
from restkv.cache import kept_positions

FIXTURES = Path(__file__).resolve().parents[2] / "data" / "fixtures" / "golden_kvpress_decoding"
KNORM = dict(method="l2norm", l2norm_skip_layers=(), window_size=0)

#: case -> the restkv options that reproduce it
CASES = {
    "decoding_knorm_i16_t320": dict(KNORM, decode_budget=320, decode_interval=16),
    "compression_ratio_decoding_knorm_r0.25_i16": dict(KNORM, decode_compression_ratio=0.25, decode_interval=16),
    "prefill_snapkv_r0.5_decoding_knorm_i16_t160": dict(method="snapkv", compression_ratio=0.5, window_size=64,
                                                        decode_method="l2norm", l2norm_skip_layers=(),
                                                        decode_budget=160, decode_interval=16),
    "dms_knorm_w32_decoding": dict(method="l2norm", l2norm_skip_layers=(), l2norm_protect_window=True,
                                   window_size=32, max_capacity_prompts=383, dms=True, dms_threshold=-6.44,
                                   dms_decoding=True, decode_interval=1),
    "dms_kvzap_linear_injected_w32_decoding": dict(
        method="kvzap", kvzap_weights=str(PREFILL_FIXTURES / "kvzap_linear_llama.safetensors"), window_size=32,
        max_capacity_prompts=383, dms=True, dms_threshold=-1.08, dms_decoding=True, decode_interval=1),
}


@functools.cache
def fixture(case: str) -> dict:
    with np.load(FIXTURES / f"case_llama__{case}.npz") as arrays:
        return {name: arrays[name] for name in arrays.files}


def held_mask(cache, width: int) -> np.ndarray:
    """``[L, H_kv, width]`` the positions each layer and KV head of row 0 holds."""
    held = kept_positions(cache)
    mask = np.zeros((len(held), len(held[0].exact[0]), width), dtype=bool)
    for layer, positions in enumerate(held):
        for head, kept in enumerate(positions.exact[0]):
            mask[layer, head, list(kept)] = True
    return mask


def test_a_prefilter_then_a_method_keep_the_composed_press_set():
    case = "composed_snapkv0.3_knorm0.4"
    model = tiny_llama("sdpa")
    with torch.no_grad(), restkv.compression(model, method="l2norm", l2norm_skip_layers=(), window_size=64,
                                             prefilter="snapkv", prefilter_ratio=0.3,
                                             compression_ratio=1 - 160 / 384):
        cache = model.model(input_ids=prompt(), use_cache=True).past_key_values
    assert np.array_equal(held_mask(cache, 384), fixture(case)["kept_mask"].astype(bool))


@pytest.mark.parametrize("case", sorted(CASES))
def test_restkv_holds_the_kvpress_set_after_every_decoding_step(case):
    arrays = fixture(case)
    expected = arrays.get("kept_tiebreak_low", arrays["kept"])
    model = tiny_llama("sdpa")
    ids = torch.from_numpy(arrays["decode_ids"])
    with torch.no_grad(), restkv.compression(model, **CASES[case]):
        cache = model.model(input_ids=prompt(), use_cache=True).past_key_values
        assert np.array_equal(held_mask(cache, 384), arrays["kept_after_prefill"])
        for step, token in enumerate(ids.tolist()):
            cache = model.model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[384 + step]]),
                                past_key_values=cache, use_cache=True).past_key_values
            held = held_mask(cache, expected.shape[-1])
            assert np.array_equal(held, expected[step]), f"step {step}: {np.argwhere(held != expected[step])[:8]}"
