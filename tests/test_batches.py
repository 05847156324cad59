"""Left-padded batches under compression: each row equals its single-row run."""

import pytest
import torch

from restkv.compat import output_cache
from tiny_models import FAMILY_BACKENDS, left_padded, replace_for, tiny_model

LENGTHS = [90, 64, 41]


def greedy(model, input_ids, attention_mask=None):
    return model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
        output_logits=True, return_dict_in_generate=True, pad_token_id=0,
    )


@pytest.mark.parametrize("family, backend", FAMILY_BACKENDS)
@pytest.mark.parametrize("method", ["snapkv", "streamingllm", "tova"])
def test_each_row_of_a_left_padded_batch_equals_its_single_row_run(family, backend, method):
    model = tiny_model(family, backend)
    replace_for(family)(method=method, max_capacity_prompts=24, window_size=8)
    input_ids, attention_mask = left_padded(LENGTHS)
    batched = greedy(model, input_ids, attention_mask)
    width = input_ids.shape[1]
    for row, length in enumerate(LENGTHS):
        alone = greedy(model, input_ids[row : row + 1, width - length :])
        assert torch.equal(batched.sequences[row, width:], alone.sequences[0, length:])
        for step_batched, step_alone in zip(batched.logits, alone.logits):
            torch.testing.assert_close(step_batched[row], step_alone[0], rtol=1e-4, atol=1e-4)
    layer = output_cache(batched).layers[0]
    # Rows shorter than the budget never keep padding: 24 kept per row, all real.
    assert layer.kept_counts.tolist() == [[24] * model.config.num_key_value_heads] * 3
