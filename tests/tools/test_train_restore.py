"""``python -m restkv.tools.train_restore``: the differentiable student is what ``--method restorekv`` computes."""


import pytest
import torch
from tiny_models import random_prompt, tiny_model

import restkv
import restkv.tools.train_restore as train_restore
import restkv.tools.train_scorer as train_scorer
from restkv.benchmarks.heldout_text import HELD_OUT_TYPES
from restkv.cache import kept_positions
from restkv.integrations.transformers.generation import prefill
from restkv.learned.restore import new_restore_weights, restore_weights_of, save_restore_weights

pytestmark = pytest.mark.filterwarnings("ignore:.*reconstruction prompt.*", "ignore:.*past_key_values.*")


def test_the_student_gives_the_logits_of_the_restkv_inference_path_for_the_same_kept_set_and_weights(tmp_path):
    model = tiny_model("llama")
    generator = torch.Generator().manual_seed(0)
    weights = new_restore_weights(model.model, 8, 2, 1.5, generator)
    for _, up in weights.adapters.values():
        up.normal_(0, 0.2, generator=generator)
    path = str(tmp_path / "w.safetensors")
    save_restore_weights(path, weights, {"held_out": {"test": {}}})
    weights = restore_weights_of(path)
    prompt, continuation = random_prompt(1, 96), random_prompt(1, 12, seed=5)
    with restkv.compression(model, method="restorekv", restore_weights=path, compression_ratio=0.5), torch.no_grad():
        cache = prefill(model, prompt)
        kept = train_restore.kept_masks(kept_positions(cache), 96)
        restkv_logits = model(input_ids=continuation, position_ids=torch.arange(96, 108)[None],
                              past_key_values=cache).logits
    example = train_restore.prepare(model, prompt, continuation, (0, 96), 48 - 8, 2048)
    assert all(torch.equal(kept[layer], example.kept[layer]) for layer in kept)  # KVzip at the budget less n
    with torch.no_grad():
        student = train_restore.student_logits(model, weights, example)
    torch.testing.assert_close(student, restkv_logits, rtol=1e-5, atol=1e-5)
    # and it is differentiable in the embeddings and the adapter
    parameters = [tensor.requires_grad_() for tensor in weights.parameters()]
    train_restore.divergence(example, train_restore.student_logits(model, weights, example)).backward()
    assert all(tensor.grad is not None and bool(tensor.grad.abs().sum() > 0) for tensor in parameters[:2])


def test_the_training_command_writes_weights_that_restorekv_reads(tiny_model_dir, tmp_path):
    out = tmp_path / "new_folder" / "restore.safetensors"
    train_restore.main(["--model_path", str(tiny_model_dir), "--output", str(out), "--num_sequences", "2",
                        "--epochs", "1", "--context_tokens", "64", "--continuation_tokens", "8", "--restore_tokens",
                        "2", "--rank", "2", "--ratios", "0.5", "--check_ratio", "0.5", "--threads", "1"])
    weights = restore_weights_of(str(out))
    assert weights.tokens == 2 and len(weights.adapters) == 3 * 4
    assert any(bool(up.abs().sum() > 0) for _, up in weights.adapters.values())  # trained away from LoRA's zero
    record = weights.training
    assert record["text"] == "restkv.tools.training_text" and record["restore_tokens"] == 2
    assert set(record["held_out"]) == set(HELD_OUT_TYPES)
    for report in record["held_out"].values():
        assert set(report["kvzip_kl"]) == set(report["restorekv_kl"]) == {"0.5"}
        assert all(value >= 0 for value in [*report["kvzip_kl"].values(), *report["restorekv_kl"].values()])


@pytest.mark.parametrize("flags, message", [
    (["--held_out", "0"], f"--held_out 0 --held_out_types {' '.join(HELD_OUT_TYPES)}: restore weights are written "
                          "only with a held-out report (at least 1 sequence of at least 1 type)"),
    (["--rank", "0"], "--rank must be at least 1; got 0"),
    (["--ratios", "0.5", "1.0"], "--ratios must lie in (0, 1); got 1.0"),
    (["--check_ratio", "0.99"], "--check_ratio 0.99 keeps 4 of --context_tokens 384: not more than the 8 restore "
                                "tokens and KVzip's 4 sinks"),
    (["--context_tokens", "16"], "--context_tokens 16 must hold the repeated span (at least --continuation_tokens 32)"),
    (["--output", "{tmp}"], "--output {tmp}: a folder; give a file path"),
])
def test_the_training_command_checks_its_flags_before_the_model_loads(flags, message, tmp_path, refuse_model_loading):
    refuse_model_loading(train_scorer, "load_frozen")  # the trainers load through it
    with pytest.raises(SystemExit) as stop:
        train_restore.main([flag.format(tmp=tmp_path) for flag in flags])
    assert str(stop.value) == "error: " + message.format(tmp=tmp_path)
