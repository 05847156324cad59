"""KVzip's ranking at the price of one prefill: the learned scorer, its weights and its trainer
(restkv.policies.learned_zip, restkv.learned.scorer, restkv.tools.train_scorer)."""

import json

import pytest
import torch
from tiny_models import random_prompt, replace_for, tiny_model

import restkv.tools.train_scorer as train_scorer
from restkv import ConfigError
from restkv.benchmarks.heldout_text import HELD_OUT_TYPES
from restkv.cache import kept_positions
from restkv.files.head_scores import load_head_scores
from restkv.integrations.transformers.deferred import listening_to_scores
from restkv.integrations.transformers.generation import prefill
from restkv.integrations.transformers.patching import replace_for_model
from restkv.learned.scorer import SHIPPED_WEIGHTS, LeastSquares, ScorerWeights, load_weights, missing_held_out, save
from restkv.tools.train_scorer import Collected

pytestmark = pytest.mark.filterwarnings("ignore:restkv. --observation reconstruction without")

#: the tiny Llama: 3 layers, 2 KV heads of dimension 16 (33 features per head)
TINY_SHAPE = (3, 2, 16)


def kvzip_collected(model, prompt, **options) -> Collected:
    collected = Collected()
    replace_for("llama")(method="kvzip", max_capacity_prompts=8, **options)
    with listening_to_scores(collected):
        cache = prefill(model, prompt)
    collected.kept = kept_positions(cache)
    return collected


def fitted(collected: Collected, ridge: float = 0.0) -> ScorerWeights:
    equations = LeastSquares(*TINY_SHAPE)
    for index, (x, target, mask) in collected.layers.items():
        equations.add(index, x, target, mask)
    return ScorerWeights(equations.solve(ridge)[0], "kvzip")


def test_a_scorer_fitted_exactly_to_kvzips_scores_keeps_what_kvzip_keeps(tmp_path):
    """The oracle: 30 distinct tokens (layer 0's features are those of the token alone), 33
    features per head, so least squares fits every log-score exactly; the learned scorer then
    ranks the model's (layer, head, token) entries as KVzip does."""
    model = tiny_model("llama")
    prompt = (torch.randperm(250, generator=torch.Generator().manual_seed(0))[:30] + 3)[None]
    collected = kvzip_collected(model, prompt)
    weights = fitted(collected)
    for index, (x, target, mask) in collected.layers.items():
        predicted = (x @ weights.weight[index][..., None]).squeeze(-1)
        torch.testing.assert_close(predicted[mask], target[mask], rtol=0, atol=1e-3)
    path = tmp_path / "exact.pt"
    save(path, weights)
    replace_for("llama")(method="learned_zip", max_capacity_prompts=8, learned_zip_weights=str(path))
    assert kept_positions(prefill(model, prompt)) == collected.kept


def test_the_learned_scorer_costs_no_extra_forward_and_evicts_for_real(tmp_path):
    model = tiny_model("llama")
    path = tmp_path / "weights.pt"
    save(path, fitted(kvzip_collected(model, random_prompt(1, 60, seed=3)), ridge=1e-2))
    calls = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda module, args: calls.append(1))
    replace_for("llama")(method="learned_zip", max_capacity_prompts=12, learned_zip_weights=str(path))
    cache = prefill(model, random_prompt(1, 90, seed=4))
    assert len(calls) == 1  # the prefill alone: no reconstruction pass
    counts = torch.stack([layer.kept_counts[0] for layer in cache.layers])
    assert int(counts.sum()) == 12 * 3 * 2 and len(set(counts.flatten().tolist())) > 1  # model-wide, ragged
    for layer in kept_positions(cache):
        for head in layer.exact[0]:
            assert {0, 1, 2, 3} <= set(head)  # the sinks


def test_weights_round_trip_and_bad_files_name_the_flag(tmp_path):
    weights = ScorerWeights(torch.randn(3, 2, 33), "kvzip", {"note": "test"})
    path = tmp_path / "weights.pt"
    save(path, weights)
    loaded = load_weights(path)
    assert torch.equal(loaded.weight, weights.weight) and loaded.training == {"note": "test"}
    garbage, other, damaged, infinite = (tmp_path / name for name in ("garbage.pt", "other.pt", "damaged.pt",
                                                                      "infinite.pt"))
    garbage.write_bytes(b"not a checkpoint")
    torch.save({"format": "something-else"}, other)
    torch.save({"format": "restkv-learned-scorer-1", "weight": torch.zeros(3, 32)}, damaged)
    torch.save({"format": "restkv-learned-scorer-1", "weight": torch.full((3, 2, 33), float("nan"))}, infinite)
    for bad, fragment in ((tmp_path / "missing.pt", "no such file"), (garbage, "not a readable weights file"),
                          (other, "not a learned scorer's weights file"), (damaged, "damaged weights"),
                          (infinite, "not finite")):
        with pytest.raises(ConfigError, match=f"--learned_zip_weights '{bad}'.*{fragment}"):
            replace_for("llama")(method="learned_zip", max_capacity_prompts=8, learned_zip_weights=str(bad))


def test_weights_of_another_shape_are_refused_before_the_model_runs(tmp_path):
    path = tmp_path / "weights.pt"
    save(path, ScorerWeights(torch.zeros(4, 2, 33), "kvzip"))
    with pytest.raises(ConfigError, match=r"--learned_zip_weights .* fit 4 layers x 2 KV heads of dimension 16; the "
                                          r"model has 3 x 2 of 16: train weights for it"):
        replace_for_model(tiny_model("llama"), method="learned_zip", max_capacity_prompts=8,
                          learned_zip_weights=str(path))
    with pytest.raises(ConfigError, match=r"the shipped --learned_zip_weights \(SmolLM2-135M's\) fit 30 layers"):
        replace_for_model(tiny_model("llama"), method="learned_zip", max_capacity_prompts=8)


def test_the_shipped_weights_fit_the_embedded_model_and_were_checked_on_text_they_never_saw():
    weights = load_weights(SHIPPED_WEIGHTS)
    assert weights.shape == (30, 3, 64) and weights.target == "kvzip"
    assert weights.training["model_path"] == "smollm2-135m" and weights.training["text"] == train_scorer.CORPUS_NAME
    assert set(weights.held_out) == set(HELD_OUT_TYPES) and not missing_held_out(weights, list(HELD_OUT_TYPES))
    for report in weights.held_out.values():
        assert report["recall"] > 0.5 and report["token_overlap"] < 0.01 and report["word_overlap"] < 0.01
    assert all(shares["token_overlap"] < 0.01 for shares in weights.training["benchmark_overlap"].values())


def test_the_training_command_writes_weights_the_method_loads_and_head_scores_headkv_reads(tiny_model_dir,
                                                                                             tmp_path):
    out, heads = tmp_path / "weights.pt", tmp_path / "new_folder" / "heads.json"  # a folder it makes
    save(tmp_path / "b.pt", ScorerWeights(torch.randn(*TINY_SHAPE[:2], 33, generator=torch.Generator().manual_seed(0)),
                                          "kvzip"))
    weights = train_scorer.main(["--model_path", str(tiny_model_dir), "--output", str(out), "--num_sequences", "3",
                                 "--held_out", "1", "--seq_len", "96", "--head_scores_output", str(heads),
                                 "--held_out_types", "code", "dialogue", "--baseline_weights", str(tmp_path / "b.pt")])
    assert weights.shape == TINY_SHAPE and torch.equal(load_weights(out).weight, weights.weight)
    assert weights.training["tokens"] > 0 and weights.training["sequences"] == 3
    # the report: per held-out type asked, the recall on its sequence and the overlap with the training text
    report = load_weights(out).held_out
    assert set(report) == {"code", "dialogue"} and all(0 <= line["recall"] <= 1 for line in report.values())
    assert all(line["token_overlap"] < 0.01 and line["word_overlap"] < 0.01 for line in report.values())
    baseline = weights.training["baseline"]["recall"]  # other weights judged on the same passes
    assert set(baseline) == {"code", "dialogue"} and baseline != {name: line["recall"] for name, line in report.items()}
    assert len(weights.training["benchmark_overlap"]) > 10  # the synthetic prose, RULER's tasks, the needle's prompt
    model = tiny_model("llama", vocab_size=49152)
    replace_for_model(model, method="learned_zip", max_capacity_prompts=8, learned_zip_weights=str(out))
    importance = load_head_scores(heads, 3, 4)  # every query head, each KV head's value for its group
    assert torch.equal(importance[:, 0], importance[:, 1]) and bool((importance > 0).all())
    assert len(json.loads(heads.read_text())["0-0"]) == 3  # one entry per sequence
    replace_for_model(model, method="headkv", max_capacity_prompts=8, window_size=4, head_scores=str(heads))
    assert prefill(model, random_prompt(1, 40)).layers[0].kept_counts.sum() > 0


@pytest.mark.parametrize("flags, message", [
    # the weights were lost: a path found unwritable only when they were saved, after the training (R2)
    (["--output", "{tmp}"], "--output {tmp}: a folder; give a file path"),
    (["--output", "{tmp}/a_file/w.pt"], "--output {tmp}/a_file/w.pt: cannot make its folder: {tmp}/a_file is a file"),
    (["--head_scores_output", "{tmp}"], "--head_scores_output {tmp}: a folder; give a file path"),
    # no held-out report, no weights
    (["--held_out", "0"], "--held_out 0 --held_out_types code records dialogue news: weights are written only with a"),
    (["--held_out_types"], "--held_out 2 --held_out_types (none): weights are written only with a held-out report"),
    (["--baseline_weights", "{tmp}/a_file"], "--baseline_weights '{tmp}/a_file' is not a readable weights file"),
    (["--ridge", "-1"], "--ridge must be >= 0; got -1.0"),
    (["--seq_len", "10"], "--seq_len must be at least 64"),
])
def test_the_training_command_checks_its_flags_before_the_model_loads(flags, message, tmp_path, refuse_model_loading):
    refuse_model_loading(train_scorer, "load_frozen")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as stop:
        train_scorer.main(["--num_sequences", "3", *(flag.format(tmp=tmp_path) for flag in flags)])
    assert str(stop.value.code).startswith(f"error: {message.format(tmp=tmp_path)}")


def test_weights_without_a_held_out_report_are_not_written(tmp_path):
    path = tmp_path / "w.pt"
    partial = {"held_out": {"code": {"recall": 0.8, "token_overlap": 0.0, "word_overlap": 0.0},
                            "news": {"recall": 0.7}}}
    for training, missing in (({}, "code, news"), (partial, "news"), (partial, "any held-out type")):
        with pytest.raises(SystemExit, match=f"error: no held-out report for {missing}: weights not written"):
            train_scorer.write_weights(str(path), ScorerWeights(torch.zeros(3, 2, 33), "kvzip", training),
                                       [] if missing == "any held-out type" else ["code", "news"])
        assert not path.exists()
    train_scorer.write_weights(str(path), ScorerWeights(torch.zeros(3, 2, 33), "kvzip", partial), ["code"])
    assert load_weights(path).held_out == partial["held_out"]


@pytest.mark.parametrize("family, message", [
    ("gpt2", "model type 'gpt2' is not supported by restkv: GPT2Attention needs an attention that"),  # a traceback
    # KVzip does not compress Cohere 2's sliding-window layers: told after every sequence had run
    ("cohere2", "KVzip scores no token of layers [0, 2] (sliding-window layers it does not compress)"),
])
def test_a_model_the_scorer_cannot_be_fitted_to_is_one_error_line(family, message, tiny_folder_of, tmp_path,
                                                                   monkeypatch):
    prefills = []
    monkeypatch.setattr(train_scorer, "prefill", lambda *args, **kwargs: prefills.append(prefill(*args, **kwargs)))
    with pytest.raises(SystemExit) as stop:
        train_scorer.main(["--model_path", str(tiny_folder_of(family)), "--output", str(tmp_path / "w.pt"),
                           "--num_sequences", "2", "--held_out", "1", "--seq_len", "64"])
    assert str(stop.value.code).startswith("error: ") and message in stop.value.code and "\n" not in stop.value.code
    assert not (tmp_path / "w.pt").exists() and len(prefills) <= 1


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory):
    model = tiny_model("llama")
    path = tmp_path_factory.mktemp("learned") / "weights.pt"
    save(path, fitted(kvzip_collected(model, random_prompt(1, 60, seed=3)), ridge=1e-2))
    return str(path)


def test_a_left_padded_row_keeps_what_it_keeps_alone(tiny_weights):
    model = tiny_model("llama")
    replace_for("llama")(method="learned_zip", max_capacity_prompts=16, learned_zip_weights=tiny_weights)
    long, short = random_prompt(1, 80, seed=7), random_prompt(1, 60, seed=8)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 20, dtype=torch.long), short], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :20] = 0
    together = kept_positions(prefill(model, batch, attention_mask=mask))
    alone = kept_positions(prefill(model, short))
    assert [layer.exact[1] for layer in together] == [layer.exact[0] for layer in alone]


@pytest.mark.parametrize("chunked", [dict(), dict(prefill_chunk_size=32)])
def test_the_template_around_the_context_is_kept_as_kvzip_keeps_it(tiny_weights, chunked):
    """KVzip keeps the prompt's template (before and after the context span) whatever its score; a prediction of
    its ranking must too (it kept a few of the template's tokens)."""
    model = tiny_model("llama")
    replace_for("llama")(method="learned_zip", max_capacity_prompts=30, learned_zip_weights=tiny_weights, **chunked)
    kept = kept_positions(prefill(model, random_prompt(1, 80, seed=9), context_span=(10, 70)))
    template = set(range(10)) | set(range(70, 80))
    assert all(template <= set(head) for layer in kept for head in layer.exact[0])
    assert sum(len(head) for layer in kept for head in layer.exact[0]) == 3 * 2 * 30

@pytest.mark.parametrize("options, refusal", [
    (dict(residual=True), None),
    (dict(quant_method="kivi"), None),
    (dict(think=True), None),
    (dict(prefill_chunk_size=32), None),
    (dict(decode_budget=20), "--method learned_zip ranks tokens across every layer at once"),
    (dict(decode_budget=20, decode_method="l2norm"), None),
])
def test_learned_zip_composes_or_refuses_in_one_line(tiny_weights, options, refusal):
    model = tiny_model("llama")
    patch = lambda: replace_for("llama")(method="learned_zip", max_capacity_prompts=16,  # noqa: E731
                                         learned_zip_weights=tiny_weights, **options)
    if refusal is not None:
        with pytest.raises(ConfigError, match=refusal):
            patch()
        return
    patch()
    out = model.generate(random_prompt(1, 80), max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert out.sequences.shape == (1, 83) and out.past_key_values.layers[0].tokens_seen > 16


def test_chunked_learned_zip_keeps_what_the_single_pass_keeps_when_no_chunk_before_the_last_evicts(tiny_weights):
    """A learned score is fixed once its token is read: ranking the kept tokens' stored scores
    beside the last chunk's is the single pass's ranking of the same scores."""
    model = tiny_model("llama")
    ids = random_prompt(1, 96)
    replace_for("llama")(method="learned_zip", max_capacity_prompts=64, learned_zip_weights=tiny_weights)
    single = kept_positions(prefill(model, ids))
    replace_for("llama")(method="learned_zip", max_capacity_prompts=64, learned_zip_weights=tiny_weights,
                         prefill_chunk_size=32)
    chunked = kept_positions(prefill(model, ids))
    assert [layer.exact for layer in chunked] == [layer.exact for layer in single]
    assert any(len(head) < 96 for layer in single for head in layer.exact[0])


def test_a_run_whose_model_wide_ranking_leaves_a_layer_whole_still_counts_as_compressed(tmp_path):
    """The runners' check that a run compressed: one ranking across the model may give a layer
    every token (here layer 0, whose scores are all highest), and the model still evicts."""
    from restkv.benchmarks.session import compression_record

    weight = torch.zeros(3, 2, 33)
    weight[0, :, -1], weight[1:, :, -1] = 5.0, -5.0  # biases: layer 0's tokens win every slot
    path = tmp_path / "layer0.pt"
    save(path, ScorerWeights(weight, "kvzip"))
    model = tiny_model("llama")
    config = replace_for_model(model, method="learned_zip", max_capacity_prompts=16, learned_zip_weights=str(path))
    cache = prefill(model, random_prompt(1, 40))
    assert cache.layers[0].kept_counts.tolist() == [[40, 40]]
    compression_record(model, config, cache, 40)  # before: "layers [0] kept every token"
    assert int(sum(layer.kept_counts.sum() for layer in cache.layers)) == 16 * 3 * 2
