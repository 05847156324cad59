"""A whole run of the shared runner on a toy benchmark: output lines, resume, shards, the
folder's settings, the compression check."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json

import pytest
import torch
from toy_benchmark import TOY, TOY_FLAGS, TOY_MULTI, lines_of, toy_multi_samples, toy_run, toy_samples

from restkv.benchmarks import flags, runner, session
from restkv.benchmarks.errors import CompressionNotApplied
from restkv.benchmarks.prompts import encode_prompt
from restkv.benchmarks.results import read_predictions
from restkv.config import CompressionConfig
from restkv.integrations.transformers.patching import unpatch


def test_a_run_writes_one_line_per_sample_with_its_cache_record(tmp_path, tiny, tokenizer):
    folder = toy_run(tmp_path, tiny, tokenizer)
    assert folder == tmp_path / "smollm2-135m" / "snapkv_48"
    records = lines_of(folder / "logs.jsonl")
    assert [r["id"] for r in records] == [f"q{i}" for i in range(5)] and [r["index"] for r in records] == list(range(5))
    first = records[0]
    assert first["answers"] == ["4000"] and isinstance(first["pred"], str)
    assert first["question_tokens"] == 0 and first["prompt_tokens"] > 48
    # The cache has seen every token but the last generated one (never fed back).
    assert first["kv_tokens_seen"] == first["prompt_tokens"] + first["new_tokens"] - 1
    assert first["kv_layers_compressed"] == tiny.config.num_hidden_layers
    assert first["kv_tokens_stored"] == 48 + first["new_tokens"] - 1
    meta = json.loads((folder / "run_meta.json").read_text())
    expected = CompressionConfig(method="snapkv", max_capacity_prompts=48, window_size=8)
    assert CompressionConfig.from_any(meta["settings"]["config"]) == expected  # the run can be rebuilt
    assert meta["settings"]["model_max_len"] == 7950 and meta["settings"]["query_agnostic"] is False
    assert meta["versions"]["torch"] == torch.__version__ and "sha" in meta["git"]


def test_query_agnostic_run_compresses_the_context_alone(tmp_path, tiny, tokenizer):
    folder = toy_run(tmp_path, tiny, tokenizer, "--query_agnostic", "--max_num_examples", "2")
    assert folder.name == "snapkv_48_agnostic"
    records = lines_of(folder / "logs.jsonl")
    assert len(records) == 2
    for record in records:
        assert record["question_tokens"] > 0
        # The question and answer were appended after compressing the context to 48 tokens.
        assert record["kv_tokens_stored"] == 48 + record["question_tokens"] + record["new_tokens"] - 1


def test_resume_after_a_kill_loses_nothing_and_duplicates_nothing(tmp_path, tiny, tokenizer, monkeypatch):
    reference = lines_of(toy_run(tmp_path / "reference", tiny, tokenizer) / "logs.jsonl")
    real_generate, calls = session.generate, []

    def killed_on_third_sample(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(session, "generate", killed_on_third_sample)
    with pytest.raises(KeyboardInterrupt):
        toy_run(tmp_path / "resumed", tiny, tokenizer)
    path = tmp_path / "resumed" / "smollm2-135m" / "snapkv_48" / "logs.jsonl"
    assert len(lines_of(path)) == 2
    with open(path, "a", encoding="utf-8") as handle:  # the kill also tore the line in flight
        handle.write('{"id": "q2", "index": 2, "pred": "half')
    monkeypatch.setattr(session, "generate", real_generate)
    toy_run(tmp_path / "resumed", tiny, tokenizer)
    resumed = lines_of(path)
    assert [r["id"] for r in resumed] == [r["id"] for r in reference]
    assert [r["pred"] for r in resumed] == [r["pred"] for r in reference]


def test_sharded_runs_merge_to_the_unsharded_result(tmp_path, tiny, tokenizer):
    whole = toy_run(tmp_path / "whole", tiny, tokenizer)
    for shard in ("0", "1"):
        sharded = toy_run(tmp_path / "sharded", tiny, tokenizer, "--num_shards", "2", "--shard_id", shard)
    assert sorted(p.name for p in sharded.glob("*.jsonl")) == ["logs.shard-0-of-2.jsonl", "logs.shard-1-of-2.jsonl"]
    assert [r["index"] for r in lines_of(sharded / "logs.shard-1-of-2.jsonl")] == [1, 3]

    def essentials(records):
        return [(r["id"], r["index"], r["pred"], r["prompt_tokens"]) for r in records]

    assert essentials(read_predictions(sharded, "logs")) == essentials(read_predictions(whole, "logs"))


def test_a_folder_refuses_a_run_with_other_settings(tmp_path, tiny, tokenizer):
    toy_run(tmp_path, tiny, tokenizer, "--max_num_examples", "1")
    message = r"holds a run with other settings \(config.kernel_size: 5 -> 7; config.window_size: 8 -> 4\)"
    with pytest.raises(SystemExit, match=message):
        toy_run(tmp_path, tiny, tokenizer, "--kernel_size", "7", "--window_size", "4")
    toy_run(tmp_path, tiny, tokenizer, "--max_num_examples", "2")  # more samples, same settings: fine
    assert len(lines_of(tmp_path / "smollm2-135m" / "snapkv_48" / "logs.jsonl")) == 2


def test_a_common_option_the_run_leaves_idle_does_not_refuse_its_folder(tmp_path, tiny, tokenizer):
    """A window scorer's folder made before a reconstruction option existed, or under another default of it,
    resumes: the option changes none of its predictions."""
    toy_run(tmp_path, tiny, tokenizer, "--max_num_examples", "1")
    meta_path = tmp_path / "smollm2-135m" / "snapkv_48" / "run_meta.json"
    meta = json.loads(meta_path.read_text())
    assert "reconstruction_prompt" in meta["settings"]["idle_options"]
    del meta["settings"]["config"]["reconstruction_prompt"], meta["settings"]["idle_options"]
    meta["settings"]["config"]["reconstruction_chunk"] = 512
    meta_path.write_text(json.dumps(meta))
    toy_run(tmp_path, tiny, tokenizer, "--max_num_examples", "2")
    assert len(lines_of(tmp_path / "smollm2-135m" / "snapkv_48" / "logs.jsonl")) == 2


def test_a_folder_without_a_completed_sample_takes_new_settings(tmp_path, tiny, tokenizer, monkeypatch, capsys):
    """A run that failed before its first sample left run_meta.json; the fixed rerun goes ahead."""
    real_generate = session.generate

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(session, "generate", out_of_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        toy_run(tmp_path, tiny, tokenizer)
    folder = tmp_path / "smollm2-135m" / "snapkv_48"
    assert json.loads((folder / "run_meta.json").read_text())["settings"]["config"]["window_size"] == 8
    monkeypatch.setattr(session, "generate", real_generate)
    toy_run(tmp_path, tiny, tokenizer, "--window_size", "4", "--max_num_examples", "1")
    assert "held no completed sample; its run settings are replaced (config.window_size: 8 -> 4)" in (
        capsys.readouterr().err)
    assert json.loads((folder / "run_meta.json").read_text())["settings"]["config"]["window_size"] == 4
    assert len(lines_of(folder / "logs.jsonl")) == 1


def test_run_meta_records_each_datasets_fingerprint_and_expected_samples(tmp_path, tiny, tokenizer):
    folder = toy_run(tmp_path, tiny, tokenizer, "--max_num_examples", "2", "--num_shards", "2", "--shard_id", "1")
    entry = json.loads((folder / "run_meta.json").read_text())["datasets"]["logs"]
    assert entry["samples_in_data"] == 5 and entry["samples_expected"] == 2  # both shards together
    assert len(entry["fingerprint"]) == 64
    again = toy_run(tmp_path / "again", tiny, tokenizer)
    assert json.loads((again / "run_meta.json").read_text())["datasets"]["logs"]["fingerprint"] == entry["fingerprint"]


def test_a_resume_on_other_data_is_refused_and_grown_data_continue(tmp_path, tiny, tokenizer):
    samples = toy_samples(None, "logs", None)[:3]
    toy = dataclasses.replace(TOY, load_samples=lambda args, dataset, tokenizer: list(samples))
    argv = ["--save_dir", str(tmp_path), "--method", "snapkv", "--max_capacity_prompts", "48", "--window_size", "8"]
    folder = runner.main(toy, [*argv, "--max_num_examples", "2"], model=tiny, tokenizer=tokenizer)
    samples.append(toy_samples(None, "logs", None)[3])  # the data grew: the folder continues
    runner.main(toy, argv, model=tiny, tokenizer=tokenizer)
    assert [r["id"] for r in lines_of(folder / "logs.jsonl")] == ["q0", "q1", "q2", "q3"]
    samples[1] = dataclasses.replace(samples[1], context="Read another log. The door code is 1.")
    with pytest.raises(SystemExit, match="dataset logs was run on other data \\(the first 4 samples differ"):
        runner.main(toy, argv, model=tiny, tokenizer=tokenizer)
    del samples[2:]
    with pytest.raises(SystemExit, match="dataset logs was run on other data \\(the run had 4 samples, the data "
                                         "now hold 2\\)"):
        runner.main(toy, argv, model=tiny, tokenizer=tokenizer)


def test_a_file_an_option_names_is_fingerprinted_and_a_resume_against_another_is_refused(tmp_path, tiny, tokenizer):
    """IndexMem weights retrained in place between two runs once mixed two weights' predictions in
    one folder: run_meta.json stored only the path."""
    from restkv.learned.indexmem import Architecture, IndexMemLayer, IndexMemWeights

    arch = Architecture(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, features=4)
    weights = tmp_path / "weights.pt"

    def train(seed):
        IndexMemWeights(arch, [IndexMemLayer(arch, index, seed) for index in range(3)], {}).save(weights)

    train(0)
    flags = ["--method", "indexmem", "--indexmem_weights", str(weights), "--indexmem_features", "4"]
    folder = toy_run(tmp_path, tiny, tokenizer, *flags, "--max_num_examples", "1")
    recorded = json.loads((folder / "run_meta.json").read_text())["settings"]["files"]
    assert recorded == {"indexmem_weights": hashlib.sha256(weights.read_bytes()).hexdigest()}
    toy_run(tmp_path, tiny, tokenizer, *flags, "--max_num_examples", "2")  # the same file: the run resumes
    train(1)
    with pytest.raises(SystemExit, match=r"holds a run with other settings \(files.indexmem_weights: '[0-9a-f]{64}' "
                                         r"-> '[0-9a-f]{64}'\)"):
        toy_run(tmp_path, tiny, tokenizer, *flags)
    assert len(lines_of(folder / "logs.jsonl")) == 2
    plain = json.loads((toy_run(tmp_path, tiny, tokenizer, "--max_num_examples", "1") / "run_meta.json").read_text())
    assert "files" not in plain["settings"]  # runs that name no file keep their settings as before


def test_a_benchmark_flag_that_changes_predictions_is_part_of_the_run_settings(tmp_path, tiny, tokenizer):
    toy = dataclasses.replace(TOY, prediction_flags=("answer_style",))

    def add_flags(parser):
        parser.add_argument("--answer_style", default="short")

    base = ["--save_dir", str(tmp_path), "--method", "snapkv", "--max_capacity_prompts", "48", "--window_size", "8",
            "--max_num_examples", "1"]
    runner.main(toy, base, add_flags, model=tiny, tokenizer=tokenizer)
    with pytest.raises(SystemExit, match=r"benchmark_flags.answer_style: 'short' -> 'long'"):
        runner.main(toy, [*base, "--answer_style", "long"], add_flags, model=tiny, tokenizer=tokenizer)


def test_an_unpatched_model_stops_the_run(tiny, tokenizer):
    """Silent no-compression (the patch not active) must not produce plausible numbers."""
    config = CompressionConfig(method="snapkv", max_capacity_prompts=48, window_size=8)
    sample = toy_samples(None, "logs", None)[0]
    encoded = encode_prompt(tokenizer, sample, 4000)
    result = session.generate(tiny, tokenizer, encoded, 2, [2])  # conftest leaves attention unpatched
    with pytest.raises(CompressionNotApplied, match="kept every token"):
        session.compression_record(tiny, config, result.cache, len(encoded.context_ids))
    # A prompt within the budget, or the full cache, needs no compression.
    assert session.compression_record(tiny, config, result.cache, 40)["kv_layers_compressed"] == 0
    assert session.compression_record(tiny, CompressionConfig(method="fullkv"), result.cache, 500)


def _whole_by_design(tmp_path) -> dict[str, list[str]]:
    """Flags of methods that keep some layers or KV heads whole under a budget by design, on the tiny
    Llama (3 layers x 2 KV heads): DuoAttention's retrieval heads (layer 0 has only those),
    SimLayerKV's layers that are not lazy (none is at threshold 1), a LU-KV curve's unpruned heads."""
    import numpy as np

    pattern = tmp_path / "duo.json"
    pattern.write_text(json.dumps({"head_scores": [[1.0, 1.0], [0.0, 0.1], [0.9, 0.2]]}))
    curve = np.full((99, 3, 2), 1.0, dtype=np.float32)  # layers 1 and 2 keep their protected tokens alone,
    curve[:, 0] = 0.0  # so layer 0, pruned by nothing, stays whole within the run's budget
    np.save(tmp_path / "curve.npy", curve)
    return {"duo_attention": ["--method", "duo_attention", "--duo_pattern", str(pattern), "--n_sink", "4"],
            "simlayerkv": ["--method", "simlayerkv", "--simlayer_threshold", "1.0"],
            "lukv": ["--method", "snapkv", "--allocation", "lukv", "--lukv_curve", str(tmp_path / "curve.npy"),
                     "--max_capacity_prompts", "100"]}  # three layers' budgets hold layer 0's whole prompt


@pytest.mark.parametrize("method", ["duo_attention", "simlayerkv", "lukv"])
def test_methods_that_keep_layers_or_heads_whole_by_design_pass_the_compression_check(method, tmp_path, tiny,
                                                                                       tokenizer):
    """The check stopped every such run (R1: "layers [0, 2] kept every token: restkv's attention
    patch is not active"); a layer the patch did not build still stops it."""
    method_flags = _whole_by_design(tmp_path)[method]
    folder = toy_run(tmp_path / "out", tiny, tokenizer, *method_flags, "--max_num_examples", "2")
    records = lines_of(folder / "logs.jsonl")
    assert len(records) == 2 and all(r["kv_layers_compressed"] < tiny.config.num_hidden_layers for r in records)
    config = flags.compression_config_from_args(flags.parse_args(TOY, [*TOY_FLAGS, *method_flags]))
    encoded = encode_prompt(tokenizer, toy_samples(None, "logs", None)[0], 4000)
    unpatch()
    unpatched = session.generate(tiny, tokenizer, encoded, 2, [2])
    with pytest.raises(CompressionNotApplied, match=r"layers \[0, 1, 2\] .*patch is not active"):
        session.compression_record(tiny, config, unpatched.cache, len(encoded.context_ids))


def test_a_layer_built_by_the_patch_that_kept_everything_under_a_uniform_budget_is_not_called_unpatched(
        tmp_path, tiny, tokenizer, monkeypatch):
    """The patch is active (the layers are restkv's) but the method kept every token where its
    allocation must evict: a different fault, told as such. A layer one of whose KV heads evicted
    did compress (a head-adaptive allocation may give another head everything)."""
    import restkv.cache

    config = CompressionConfig(method="snapkv", max_capacity_prompts=48, window_size=8)
    encoded = encode_prompt(tokenizer, toy_samples(None, "logs", None)[0], 4000)
    with restkv.compression(tiny, config):
        result = session.generate(tiny, tokenizer, encoded, 2, [2])
    real_report = restkv.cache.cache_report
    whole_in_layer_1: list[str] = []  # the report's fields set to the tokens the layer saw

    def reported(cache):
        return [dataclasses.replace(r, **{name: r.tokens_seen for name in whole_in_layer_1}) if r.layer == 1 else r
                for r in real_report(cache)]

    monkeypatch.setattr(restkv.cache, "cache_report", reported)
    whole_in_layer_1.append("stored_max")  # one head kept all it saw
    assert session.compression_record(tiny, config, result.cache, len(encoded.context_ids))
    whole_in_layer_1.append("stored_min")  # every head did
    with pytest.raises(CompressionNotApplied, match=r"layers \[1\] were built by restkv but kept every token"):
        session.compression_record(tiny, config, result.cache, len(encoded.context_ids))


def test_a_method_the_models_rope_refuses_is_one_error_line(tmp_path, tokenizer):
    """Cohere 2 rotates interleaved channel pairs, which restkv does not undo: the library's refusal
    of a method that reads keys before RoPE was a ValueError traceback (R10)."""
    from test_command_lines import one_line_error
    from tiny_models import tiny_model

    cohere2 = tiny_model("cohere2", vocab_size=len(tokenizer))
    message = one_line_error(lambda: toy_run(tmp_path, cohere2, tokenizer, "--method", "leverage"))
    assert message.startswith("error: --method leverage reads keys before RoPE; cohere2 layer 0 rotates them")


def test_a_model_type_restkv_does_not_serve_is_refused_before_it_loads(no_model_loading, tiny_folder_of, tmp_path,
                                                                        tokenizer):
    from test_command_lines import one_line_error

    folder = tiny_folder_of("gpt2")
    message = one_line_error(lambda: runner.main(TOY, ["--save_dir", str(tmp_path), *TOY_FLAGS, "--model_path",
                                                       str(folder)], tokenizer=tokenizer))
    assert message.startswith(f"error: --model_path {folder}: model type 'gpt2' is not supported by restkv: "
                              "GPT2Attention needs an attention that")


def test_a_cache_compressed_with_other_settings_than_the_runs_stops_the_run(tmp_path, tiny, tokenizer):
    """configure() after the start leaves the model at other settings than the folder records."""
    from restkv.benchmarks.errors import CompressionMismatch
    from restkv.benchmarks.flags import parse_args
    from restkv.integrations.transformers.patching import configure

    args = parse_args(TOY, ["--save_dir", str(tmp_path), "--method", "h2o", "--max_capacity_prompts", "64",
                            "--window_size", "8"])
    with contextlib.closing(session.BenchmarkRun.start(TOY, args, ["logs"], model=tiny, tokenizer=tokenizer)) as run:
        sample = toy_samples(None, "logs", None)[0]
        assert run.answer(sample)[0]["kv_layers_compressed"] == tiny.config.num_hidden_layers
        configure(tiny, method="snapkv", max_capacity_prompts=16)
        mismatch = ("compressed with method 'snapkv', max_capacity_prompts 16\\b.*the run's settings say method "
                    "'h2o', max_capacity_prompts 64")
        with pytest.raises(CompressionMismatch, match=mismatch):
            run.answer(sample)
    # A model handed to a new run with a configure()d config of its own compresses with the run's.
    with contextlib.closing(session.BenchmarkRun.start(TOY, args, ["logs"], model=tiny, tokenizer=tokenizer)) as run:
        (record,) = run.answer(sample)
        assert record["kv_tokens_stored"] == 64 + record["new_tokens"] - 1


@pytest.mark.parametrize("switches", [[], ["--residual"]])
def test_a_prompt_too_short_for_a_ratio_budget_is_answered_with_the_full_cache(tmp_path, tiny, tokenizer, switches):
    """At --compression_ratio 0.9 a short prompt keeps no more than the window: the library refuses
    to compress it, and such a sample must not stop the run (nor every resume)."""
    from restkv.integrations.transformers.patching import config_of

    long, short = toy_samples(None, "logs", None)[:2]
    short = dataclasses.replace(short, context="Read the log. The door code is 4017.\n\n")
    toy = dataclasses.replace(TOY, load_samples=lambda args, dataset, tokenizer: [long, short])
    argv = ["--save_dir", str(tmp_path), "--method", "snapkv", "--compression_ratio", "0.9", "--window_size", "16",
            *switches]
    folder = runner.main(toy, argv, model=tiny, tokenizer=tokenizer)
    first, second = lines_of(folder / "logs.jsonl")
    assert "compressed" not in first and first["kv_layers_compressed"] == tiny.config.num_hidden_layers
    assert second["compressed"] is False and second["kv_layers_compressed"] == 0
    assert second["uncompressed_reason"] == (
        f"a row of {second['context_tokens']} tokens keeps {second['context_tokens'] // 10} tokens "
        "(--compression_ratio 0.9), which does not exceed the 16 protected tokens (--window_size 16); lower the ratio "
        "or the window")
    assert second["kv_tokens_stored"] == second["kv_tokens_seen"]
    assert config_of(tiny) == CompressionConfig(method="snapkv", compression_ratio=0.9, window_size=16,
                                                residual=bool(switches))



def test_kvzip_sinks_that_fill_a_ratio_budget_answer_with_the_full_cache_and_say_why(tmp_path, tiny, tokenizer):
    """--n_sink above every prompt once stopped the run with "restkv's attention patch is not
    active" (the sinks' ties emptied whole layers); each line now says what keeps it uncompressed."""
    argv = ["--save_dir", str(tmp_path), "--method", "kvzip", "--compression_ratio", "0.9", "--n_sink", "2000",
            "--query_agnostic", "--reconstruction_chunk", "64", "--max_num_examples", "2"]
    folder = runner.main(TOY, argv, model=tiny, tokenizer=tokenizer)
    for record in lines_of(folder / "logs.jsonl"):
        assert record["compressed"] is False and record["kv_layers_compressed"] == 0
        assert record["uncompressed_reason"].endswith(
            "which does not exceed --n_sink 2000 (the first --n_sink tokens are always kept)")


# ----------------------------------------------------------------------------- multi-question samples


def without_timing(records):
    return [{name: value for name, value in record.items() if name not in ("index", "seconds")} for record in records]


def test_a_multi_question_sample_is_compressed_once_and_answers_each_question_as_if_asked_alone(
        tmp_path, tiny, tokenizer, prefill_calls):
    folder = toy_run(tmp_path / "multi", tiny, tokenizer, benchmark=TOY_MULTI)
    assert len(prefill_calls) == 3  # one compression per sample, not per question
    records = lines_of(folder / "logs.jsonl")
    assert [r["id"] for r in records] == [f"log{i}/{k}" for i in range(3) for k in range(3)]
    assert [r["index"] for r in records] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [r["answers"] for r in records[3:6]] == [["5101"], ["5108"], ["5115"]] and records[4]["log"] == 1
    for record in records:
        assert record["question_tokens"] > 0 and record["kv_layers_compressed"] == tiny.config.num_hidden_layers
        assert record["kv_tokens_stored"] == 48 + record["question_tokens"] + record["new_tokens"] - 1
    assert records[0]["question_tokens"] > records[1]["question_tokens"]  # the first has its answer prefix

    samples = toy_multi_samples(None, "logs", None)
    singles = [sample.single_question(k) for sample in samples for k in range(3)]
    alone = dataclasses.replace(TOY, load_samples=lambda args, dataset, tokenizer: singles)
    single_folder = toy_run(tmp_path / "single", tiny, tokenizer, "--query_agnostic", benchmark=alone)
    assert len(prefill_calls) == 3 + 9
    assert without_timing(records) == without_timing(lines_of(single_folder / "logs.jsonl"))


def test_a_multi_question_run_expects_and_scores_a_line_per_question(tmp_path, tiny, tokenizer):
    from restkv.benchmarks import scoring

    folder = toy_run(tmp_path, tiny, tokenizer, "--max_num_examples", "2", benchmark=TOY_MULTI)
    entry = json.loads((folder / "run_meta.json").read_text())["datasets"]["logs"]
    assert entry["samples_in_data"] == 3 and entry["samples_expected"] == 6  # two samples of three questions
    (run,) = scoring.evaluate(TOY_MULTI, tmp_path)
    records = lines_of(folder / "logs.jsonl")
    expected = round(100 * sum(r["answers"][0] in r["pred"] for r in records) / 6, 2)
    assert run.datasets["logs"] == scoring.DatasetScore(expected, 6, 6) and run.complete is True


def test_a_multi_question_sample_cut_off_between_its_lines_is_redone_whole_without_duplicates(
        tmp_path, tiny, tokenizer, monkeypatch, prefill_calls):
    from restkv.benchmarks.results import ResultWriter

    reference = lines_of(toy_run(tmp_path / "reference", tiny, tokenizer, benchmark=TOY_MULTI) / "logs.jsonl")
    real_write, writes = ResultWriter.write, []

    def killed_after_four_lines(self, record):
        if len(writes) == 4:
            raise KeyboardInterrupt
        writes.append(record["id"])
        real_write(self, record)

    monkeypatch.setattr(ResultWriter, "write", killed_after_four_lines)
    with pytest.raises(KeyboardInterrupt):
        toy_run(tmp_path / "resumed", tiny, tokenizer, benchmark=TOY_MULTI)
    assert writes == ["log0/0", "log0/1", "log0/2", "log1/0"]
    monkeypatch.setattr(ResultWriter, "write", real_write)
    del prefill_calls[:]
    folder = toy_run(tmp_path / "resumed", tiny, tokenizer, benchmark=TOY_MULTI)
    assert len(prefill_calls) == 2  # log1 redone whole (one compression), then log2
    resumed = lines_of(folder / "logs.jsonl")
    assert [r["id"] for r in resumed] == [r["id"] for r in reference]
    assert [r["pred"] for r in resumed] == [r["pred"] for r in reference]


def test_multi_question_prompts_share_one_context_cut_to_leave_room_for_the_longest_question(tokenizer):
    from restkv.benchmarks.errors import FlagError
    from restkv.benchmarks.prompts import encode_questions

    sample = toy_multi_samples(None, "logs", None)[0]
    whole = encode_questions(tokenizer, sample, 4000)
    assert whole == [encode_prompt(tokenizer, sample.single_question(k), 4000, split=True)
                     for k in range(3)]
    cut = encode_questions(tokenizer, sample, 100)
    assert all(p.truncated and p.context_ids == cut[0].context_ids for p in cut)
    assert [p.question_ids for p in cut] == [p.question_ids for p in whole]  # questions are never cut
    text = tokenizer.decode(cut[0].context_ids)
    assert "Read the log." in text and "east door code is 5014." in text  # cut in the middle
    assert text.count("the sea was calm") < tokenizer.decode(whole[0].context_ids).count("the sea was calm")
    with pytest.raises(FlagError, match="--model_max_len 12 leaves no room for the context of sample 'log0', whose "
                                        "longest question has 1[0-9] tokens"):
        encode_questions(tokenizer, sample, 12)


def test_a_sample_with_questions_has_no_question_of_its_own_and_plain_digests_are_unchanged():
    from restkv.benchmarks.benchmark import Question, Sample
    from restkv.benchmarks.run_folder import sample_digest

    with pytest.raises(ValueError, match="sample 'a' has questions, so no question or answer_prefix of its own"):
        Sample("a", "context", "question?", 3, questions=(Question("other?"),))
    # The digest a folder written before multi-question samples recorded: such folders still resume.
    plain = toy_samples(None, "logs", None)[0]
    assert sample_digest(plain).hex() == "513e889a62eebbb74e905d9905c38501b3c51ca6d7e58f834b290f78a192b0b5"
    assert plain.line_ids == ["q0"]


def test_a_delimited_finch_run_puts_the_delimiter_before_the_question_and_answers_as_its_window(
        tmp_path, tiny, tokenizer):
    """--finch_delimiter: each query-aware prompt holds the delimiter between context and question; the model reads
    the prompt without it, with the question (and the template's closing) as the window: the lines of a run with
    that window given as --window_size, token for token."""
    finch = ["--method", "finch"]
    delimited = toy_run(tmp_path / "delimited", tiny, tokenizer, *finch, "--finch_delimiter", str(len(tokenizer)))
    sample = toy_samples(None, "logs", tokenizer)[0]
    question = len(encode_prompt(tokenizer, sample, 7950, split=True).question_ids)
    plain = toy_run(tmp_path / "plain", tiny, tokenizer, *finch, "--window_size", str(question))
    assert without_timing(lines_of(delimited / "logs.jsonl")) == without_timing(lines_of(plain / "logs.jsonl"))
    ids = encode_prompt(tokenizer, sample, 7950, delimiter=len(tokenizer)).context_ids
    assert ids[-question - 1] == len(tokenizer) and len(ids) == lines_of(plain / "logs.jsonl")[0]["prompt_tokens"] + 1


def test_a_delimited_finch_run_refuses_query_agnostic_prompts(tmp_path, tiny, tokenizer):
    with pytest.raises(SystemExit) as stop:
        toy_run(tmp_path, tiny, tokenizer, "--method", "finch", "--finch_delimiter", "9", "--query_agnostic")
    assert str(stop.value.code).startswith("error: --finch_delimiter 9 finds the window from the question in the "
                                           "prompt; --query_agnostic")


def test_a_duo_run_scored_on_the_fly_runs_and_records_the_pattern_it_wrote(tmp_path, tiny_model_dir, tokenizer):
    """--duo_on_the_fly: the model's heads are scored when the runner configures it, and the compression check reads
    the config the model runs (its --duo_pattern the file the scores were written to)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa").eval()
    folder = toy_run(tmp_path, model, tokenizer, "--method", "duo_attention", "--duo_on_the_fly",
                     "--max_capacity_prompts", "40", "--max_num_examples", "2")
    records = lines_of(folder / "logs.jsonl")
    assert len(records) == 2 and all(record["kv_tokens_stored"] < record["kv_tokens_seen"] for record in records)
    config = json.loads((folder / "run_meta.json").read_text())["settings"]["config"]
    assert config["duo_on_the_fly"] is True and config["duo_pattern"] is None
