"""KVzap's surrogates trained here (restkv.tools.train_kvzap, restkv.learned.kvzap): the fits, the file
round trip, the held-out report a file is not written without, the command on a tiny model."""

import pytest
import torch
from tiny_models import random_qkv

import restkv.tools.train_kvzap as train_kvzap
import restkv.tools.train_scorer as train_scorer
from restkv import compress_kv
from restkv.benchmarks.heldout_text import HELD_OUT_TYPES
from restkv.learned.kvzap import fit_linear, fit_mlp, predict, save_surrogates, surrogates_of, training_record


def test_the_linear_fit_recovers_a_linear_map_with_its_intercept():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(200, 12, generator=generator) * torch.linspace(0.1, 10, 12) + 3
    weight, bias = torch.randn(2, 12, generator=generator), torch.tensor([-4.0, 1.5])
    (fitted, fitted_bias), = fit_linear(hidden, hidden @ weight.T + bias, ridge=0.0)
    assert torch.allclose(fitted, weight, atol=1e-4) and torch.allclose(fitted_bias, bias, atol=1e-3)
    (shrunk, _), = fit_linear(hidden, hidden @ weight.T + bias, ridge=10.0)
    assert shrunk.norm() < 0.9 * weight.norm()


def flat(surrogate):
    return [tensor for pair in surrogate for tensor in pair]


def nonlinear_data(seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(300, 8, generator=generator) * 5 + 2  # raw scales the fit must standardise
    targets = torch.stack([(hidden[:, 0] / 5).abs() * 3 - 8, (hidden[:, 1] * hidden[:, 2] / 25).tanh()], dim=-1)
    return hidden, targets


def test_the_mlp_learns_what_a_linear_map_cannot_and_reads_raw_hidden_states():
    hidden, targets = nonlinear_data()
    mlp = fit_mlp(hidden, targets, 32, 40, 5e-3, 64, torch.Generator().manual_seed(0))
    assert [tuple(weight.shape) for weight, _ in mlp] == [(32, 8), (2, 32)]
    linear = fit_linear(hidden, targets, 0.0)
    mlp_error = (predict(mlp, hidden) - targets).square().mean(dim=0)
    linear_error = (predict(linear, hidden) - targets).square().mean(dim=0)
    assert bool((mlp_error < 0.5 * linear_error).all())


def test_the_mlp_is_deterministic_given_its_seed():
    hidden, targets = nonlinear_data()
    fits = [fit_mlp(hidden, targets, 16, 2, 5e-3, 64, torch.Generator().manual_seed(seed)) for seed in (3, 3, 4)]
    assert all(torch.equal(a, b) for a, b in zip(flat(fits[0]), flat(fits[1])))
    assert not torch.equal(fits[0][0][0], fits[2][0][0])


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_a_written_file_holds_the_surrogates_and_how_they_were_made(tmp_path, kind):
    hidden, targets = nonlinear_data()
    surrogate = (fit_linear(hidden, targets, 1e-3) if kind == "linear"
                 else fit_mlp(hidden, targets, 8, 1, 5e-3, 64, torch.Generator().manual_seed(0)))
    training = {"kind": kind, "held_out": {"code": {"kvzap_recall": {"0.1": 0.5}}}}
    save_surrogates(tmp_path / "s.safetensors", [surrogate, surrogate], training)
    loaded = surrogates_of(str(tmp_path / "s.safetensors"))
    assert len(loaded) == 2 and all(torch.equal(a, b) for maps in loaded for a, b in zip(flat(maps), flat(surrogate)))
    assert training_record(tmp_path / "s.safetensors") == training


def test_no_file_is_written_without_a_held_out_report(tmp_path):
    hidden, targets = nonlinear_data()
    with pytest.raises(ValueError, match="no held-out report"):
        save_surrogates(tmp_path / "s.safetensors", [fit_linear(hidden, targets, 0.0)], {"kind": "linear"})
    assert not (tmp_path / "s.safetensors").exists()


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_the_training_command_writes_surrogates_the_method_scores_with(tiny_model_dir, tmp_path, kind):
    out = tmp_path / "new_folder" / "kvzap.safetensors"  # a folder it makes
    surrogates = train_kvzap.main(["--model_path", str(tiny_model_dir), "--kind", kind, "--output", str(out),
                                   "--num_sequences", "2", "--seq_len", "96", "--held_out", "1", "--epochs", "2",
                                   "--hidden", "8", "--threads", "1"])
    assert len(surrogates) == 3 and len(surrogates[0]) == (1 if kind == "linear" else 2)
    record = training_record(out)
    assert record["kind"] == kind and record["text"] == "restkv.tools.training_text"
    assert set(record["held_out"]) == set(HELD_OUT_TYPES)
    for report in record["held_out"].values():
        for scorer in ("kvzap_recall", "learned_zip_recall"):
            assert set(report[scorer]) == {"0.1", "0.2"} and all(0 <= v <= 1 for v in report[scorer].values())
    # the file, read by --method kvzap, scores a layer's tokens with the trained module's predictions
    query, key, value = random_qkv(length=50, seed=5)
    hidden = torch.randn(1, 50, 64, generator=torch.Generator().manual_seed(6))
    kept = compress_kv(query, key, value, dict(method="kvzap", max_capacity_prompts=20, window_size=0,
                                               kvzap_weights=str(out)), layer_idx=2, num_layers=3,
                       hidden_states=hidden).indices
    predicted = predict(surrogates[2], hidden[0])
    for head in range(2):
        assert set(kept[0, head].tolist()) == set(predicted[:, head].topk(20).indices.tolist())


@pytest.mark.parametrize("flags, message", [
    (["--held_out", "0"], f"--held_out 0 --held_out_types {' '.join(HELD_OUT_TYPES)}: surrogates are written only "
                          "with a held-out report (at least 1 sequence of at least 1 type)"),
    (["--held_out_types"], "--held_out 2 --held_out_types (none): surrogates are written only with a held-out "
                            "report (at least 1 sequence of at least 1 type)"),
    (["--hidden", "0"], "--hidden must be at least 1; got 0"),
    (["--check_ratio", "0.1", "1.5"], "--check_ratio must lie in (0, 1); got [0.1, 1.5]"),
    (["--lr", "0"], "--lr must be > 0; got 0.0"),
    (["--output", "{tmp}"], "--output {tmp}: a folder; give a file path"),
])
def test_the_training_command_checks_its_flags_before_the_model_loads(flags, message, tmp_path, refuse_model_loading):
    refuse_model_loading(train_scorer, "load_frozen")  # the trainers load through it
    with pytest.raises(SystemExit) as stop:
        train_kvzap.main([flag.format(tmp=tmp_path) for flag in flags])
    assert str(stop.value) == "error: " + message.format(tmp=tmp_path)
