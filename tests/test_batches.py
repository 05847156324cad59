"""Left-padded batches under compression: each row equals its single-row run."""

import pytest

from restkv import CompressionConfig
from restkv.compat import output_cache
from tiny_models import (FAMILY_BACKENDS, ROTATION_NOT_UNDONE, assert_rows_match_single_row_runs, registered_methods,
                         replace_for, tiny_model)

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
