"""Left-padded batches under compression: each row equals its single-row run."""

import pytest
import torch
from tiny_models import (FAMILY_BACKENDS, ROTATION_NOT_UNDONE, assert_rows_match_single_row_runs, left_padded,
                         registered_methods, replace_for, tiny_model)

from restkv import CompressionConfig
from restkv.cache import kept_positions
from restkv.integrations.transformers.compat import output_cache

LENGTHS = [90, 64, 41]


@pytest.mark.parametrize("family, backend", FAMILY_BACKENDS)
@pytest.mark.parametrize("method", registered_methods(uniform=True, keeps_inputs=True, compresses_first_layer=True))
def test_each_row_of_a_left_padded_batch_equals_its_single_row_run(family, backend, method):
    model = tiny_model(family, backend)
    replace_for(family)(method=method, max_capacity_prompts=24, window_size=8)
    policy = CompressionConfig(method=method, max_capacity_prompts=24, window_size=8).policy
    if family in ROTATION_NOT_UNDONE and policy.pre_rope_flags():
        with pytest.raises(ValueError, match=f"^--method {method} reads keys before RoPE; {family} layer 0"):
            assert_rows_match_single_row_runs(model, LENGTHS)
        return
    batched = assert_rows_match_single_row_runs(model, LENGTHS)
    layer = output_cache(batched).layers[0]
    # Rows shorter than the budget never keep padding: 24 kept per row, all real.
    assert layer.kept_counts.tolist() == [[24] * model.config.num_key_value_heads] * 3


@pytest.mark.parametrize("method", ["expected_attention", "capkv"])
def test_a_left_padded_batch_called_without_position_ids_keeps_what_it_keeps_with_their_default(method):
    """transformers then rotates every row by its columns, with one [1, N, d] table for the batch:
    the future-query scorers read it for every row, as the same positions given per row."""
    model = tiny_model("llama")
    replace_for("llama")(method=method, max_capacity_prompts=24, window_size=8)
    ids, mask = left_padded(LENGTHS)
    columns = torch.arange(ids.shape[1]).expand(len(LENGTHS), -1)
    kept = []
    for positions in (None, columns):
        with torch.no_grad():
            out = model(ids, attention_mask=mask, position_ids=positions, use_cache=True)
        kept.append(kept_positions(output_cache(out)))
    assert kept[0] == kept[1]


def test_lukv_keeps_whole_a_left_padded_row_that_fits_its_budget_as_alone(tmp_path):
    """The 50-token row fits the budget of 64: alone it is not compressed, in the batch neither."""
    import numpy as np

    path = tmp_path / "curve.npy"
    np.save(path, np.random.RandomState(0).rand(99, 3, 2).astype("float32") * 0.9)
    model = tiny_model("llama")
    replace_for("llama")(method="snapkv", allocation="lukv", lukv_curve=str(path), max_capacity_prompts=64,
                         window_size=8)
    batched = assert_rows_match_single_row_runs(model, [120, 50])
    assert all(layer.kept_counts[1].tolist() == [50, 50] for layer in output_cache(batched).layers)
