"""RULER data files, prompts, metrics, and run_ruler.py / eval_ruler.py end to end."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json

import pytest
from top_level import dry_run_script, usage_exit

from restkv.benchmarks import ruler, ruler_data, runner
from restkv.benchmarks.flags import parse_args
from restkv.benchmarks.results import read_predictions


def test_postprocess_strips_and_turns_control_characters_into_newlines():
    assert ruler.postprocess_prediction("  12\x0034\t5 \n") == "12\n34\n5"
    assert ruler.postprocess_prediction("\x01\x02") == ""


def test_string_match_metrics_follow_ruler():
    predictions = ["The numbers are 123 and 456.", "nothing here", "ABC-def"]
    references = [["123", "456", "789"], ["x"], ["abc-DEF"]]
    # all: (2/3 + 0 + 1) / 3; part: (1 + 0 + 1) / 3
    assert ruler.string_match_all(predictions, references) == 55.56
    assert ruler.string_match_part(predictions, references) == 66.67
    with pytest.raises(ValueError, match="empty"):
        ruler.string_match_all([], [])


def test_score_task_uses_the_task_metric_after_postprocessing():
    predictions, references = ["\x00 paris and rome \x01"], [["Paris", "London"]]
    assert ruler.score_task("qa_1", predictions, references) == 100.0
    assert ruler.score_task("niah_multivalue", predictions, references) == 50.0
    with pytest.raises(ValueError, match="unknown RULER task"):
        ruler.score_task("qa_9", predictions, references)


def test_parse_task_list_accepts_commas_and_aliases():
    assert ruler.parse_task_list(["niah_single_1,vt", "cwe", "vt"]) == ["niah_single_1", "vt", "cwe"]
    assert ruler.parse_task_list("synthetic") == list(ruler.SYNTHETIC_TASKS) and len(ruler.SYNTHETIC_TASKS) == 11
    assert ruler.parse_task_list("all")[-2:] == ["qa_1", "qa_2"]
    with pytest.raises(ValueError, match="unknown RULER task 'vt2'"):
        ruler.parse_task_list("vt2")


def test_official_generation_lengths_and_metrics():
    expected = {"niah_single_1": 128, "niah_multiquery": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa_1": 32}
    assert {t: ruler.get_task(t).tokens_to_generate for t in expected} == expected
    assert {t: ruler.get_task(t).metric for t in ("qa_2", "fwe")} == {"qa_2": "part", "fwe": "all"}


def _write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_both_data_layouts_are_found(tmp_path):
    official = {"index": 0, "input": "official", "outputs": ["1"], "length": 10, "answer_prefix": " A:"}
    flat = {"index": 0, "input": "flat prompt with its prefix A:", "outputs": "2", "length": 12}
    _write_jsonl(tmp_path / "4096" / "vt" / "validation.jsonl", [official])
    _write_jsonl(tmp_path / "4096" / "cwe.jsonl", [flat])
    _write_jsonl(tmp_path / "8192" / "data" / "fwe" / "validation.jsonl", [official])
    assert ruler.load_task(tmp_path, 4096, "vt") == [official]
    assert ruler.load_task(tmp_path, 4096, "cwe")[0]["outputs"] == ["2"]
    assert ruler.load_task(tmp_path, 8192, "fwe")[0]["input"] == "official"
    with pytest.raises(FileNotFoundError, match=r"4096/fwe/validation.jsonl.*python -m restkv.data ruler"):
        ruler.load_task(tmp_path, 4096, "fwe")
    _write_jsonl(tmp_path / "4096" / "niah_single_1.jsonl", [{"input": "no answers"}])
    with pytest.raises(ValueError, match=r"niah_single_1.jsonl:1: .*'outputs'"):
        ruler.load_task(tmp_path, 4096, "niah_single_1")


def test_prompt_is_chat_wrapped_input_then_answer_prefix(smollm2_tokenizer):
    sample = {"input": "Question body?", "answer_prefix": " The answer is"}
    prompt = ruler.build_prompt(sample, smollm2_tokenizer, use_chat_template=True)
    assert prompt.endswith("Question body?<|im_end|>\n<|im_start|>assistant\n The answer is")
    assert ruler.build_prompt(sample, smollm2_tokenizer, use_chat_template=False) == "Question body? The answer is"
    assert ruler.build_prompt({"input": "old data ends with Answer:"}, smollm2_tokenizer, False).endswith("Answer:")


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from restkv.integrations.transformers.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.mark.parametrize("task", ["niah_multiquery", "vt", "cwe", "fwe", "niah_multikey_3"])
def test_split_question_separates_the_question_from_the_context(smollm2_tokenizer, task):
    (sample,) = ruler_data.generate_task(task, 1024, 1, smollm2_tokenizer)
    context, question = ruler.split_question(task, sample["input"])
    assert context + question == sample["input"]
    assert question.startswith(ruler.QUESTION_MARKERS[ruler.get_task(task).family_name])
    assert all(answer in context for answer in sample["outputs"])
    assert ruler.split_question(task, "no marker here") == ("no marker here", "")


def test_score_table_and_files(tmp_path):
    scores = {8192: {"vt": 50.0, "niah_single_1": 100.0}, 4096: {"vt": 70.0, "niah_single_1": 90.0, "cwe": 20.0}}
    columns, rows = ruler.score_table(scores)
    assert columns == ["niah_single_1", "vt", "cwe", "Avg"]
    assert [row["length"] for row in rows] == ["4096", "8192", "mean"]
    assert rows[0]["Avg"] == 60.0 and rows[1]["Avg"] == 75.0 and "cwe" not in rows[1]
    assert rows[2] == {"length": "mean", "niah_single_1": 95.0, "vt": 60.0, "cwe": 20.0, "Avg": 67.5}
    json_path, csv_path = ruler.write_scores(scores, tmp_path)
    assert json.loads(json_path.read_text()) == {"4096": scores[4096], "8192": scores[8192]}
    table = list(csv.DictReader(csv_path.open()))
    assert table[1] == {"length": "8192", "niah_single_1": "100.0", "vt": "50.0", "cwe": "", "Avg": "75.0"}


def test_eval_says_when_nothing_could_be_scored_and_marks_partial_tasks(tmp_path, capsys):
    run = tmp_path / "snapkv_64"
    (run / "600").mkdir(parents=True)
    (run / "600" / "vt.jsonl").write_text("")  # a run that stopped before its first sample
    expected = {"fingerprint": "0" * 64, "samples_in_data": 2, "samples_expected": 2}
    (run / "run_meta.json").write_text(json.dumps({"settings": {"benchmark": "ruler"},
                                                   "datasets": {"600/vt": expected, "600/cwe": expected}}))
    with pytest.raises(SystemExit, match="nothing to score"):
        ruler.evaluate(["--results_dir", str(tmp_path)])
    _write_jsonl(run / "600" / "vt.jsonl", [{"id": "0", "index": 0, "pred": "A B", "outputs": ["A", "B"]}])
    _write_jsonl(run / "600" / "cwe.jsonl", [{"id": str(i), "index": i, "pred": "x", "outputs": ["x"]}
                                             for i in range(2)])
    results = ruler.evaluate(["--results_dir", str(tmp_path)])
    assert results[run] == {600: {"vt": 100.0, "cwe": 100.0}}
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["length", "vt", "cwe", "Avg", "samples"]
    assert lines[2].split() == ["600", "100.00*", "100.00", "100.00*", "3/4"]
    assert "* snapkv_64 / 600/vt: 1/2 samples" in lines


# ----------------------------------------------------------------------------- end to end


def _run(smollm2, ruler_dir, save_dir, *extra, datasets="niah_single_1,fwe"):
    model, tokenizer = smollm2
    argv = ["--model_path", "smollm2-135m", "--data_dir", str(ruler_dir), "--context_lengths", "600",
            "--datasets", datasets, "--method", "snapkv", "--max_capacity_prompts", "128",
            "--max_new_tokens", "8", "--save_dir", str(save_dir), *extra]
    return ruler.run(argv, model=model, tokenizer=tokenizer)


@pytest.mark.embedded
def test_run_resume_shards_and_eval(smollm2, ruler_dir, tmp_path):
    # A run killed while writing its second fwe line: one sample per task done, half a line after.
    folder = _run(smollm2, ruler_dir, tmp_path / "whole", "--max_num_examples", "1")
    fwe_file = folder / "600" / "fwe.jsonl"
    done = fwe_file.read_text()
    with open(fwe_file, "a") as handle:
        handle.write('{"id": "1", "index": 1, "pred": "abc')
    assert _run(smollm2, ruler_dir, tmp_path / "whole") == folder
    lines = [json.loads(line) for line in fwe_file.read_text().splitlines()]
    assert fwe_file.read_text().startswith(done) and [r["id"] for r in lines] == ["0", "1"]

    data = ruler.load_task(ruler_dir, 600, "niah_single_1")
    niah = read_predictions(folder / "600", "niah_single_1")
    assert [r["outputs"] for r in niah] == [d["outputs"] for d in data]
    # The runner's prompt is exactly the one the generator measured.
    assert [r["prompt_tokens"] + 128 for r in niah] == [d["length_w_model_temp"] for d in data]
    assert all(r["kv_tokens_stored"] < r["kv_tokens_seen"] and not r["truncated"] for r in niah)

    for shard in ("0", "1"):
        sharded = _run(smollm2, ruler_dir, tmp_path / "sharded", "--num_shards", "2", "--shard_id", shard,
                       datasets="niah_single_1")
    assert sorted(p.name for p in (sharded / "600").iterdir()) == [
        "niah_single_1.shard-0-of-2.jsonl", "niah_single_1.shard-1-of-2.jsonl"]
    whole = [(r["id"], r["pred"]) for r in niah]
    assert [(r["id"], r["pred"]) for r in read_predictions(sharded / "600", "niah_single_1")] == whole

    results = ruler.evaluate(["--results_dir", str(tmp_path)])
    assert set(results) == {folder, sharded}
    assert results[folder][600]["niah_single_1"] == results[sharded][600]["niah_single_1"]
    written = json.loads((folder / "ruler_scores.json").read_text())
    assert list(written) == ["600"] and set(written["600"]) == {"niah_single_1", "fwe"}
    expected_fwe = ruler.score_task("fwe", [r["pred"] for r in lines], [r["outputs"] for r in lines])
    assert written["600"]["fwe"] == expected_fwe


def test_a_resume_on_regenerated_data_is_refused(tmp_path, tiny, tokenizer):
    """RULER ids are line numbers: new data under the same ids must not join the old predictions."""
    generate = ["--tokenizer", "smollm2-135m", "--lengths", "400", "--tasks", "niah_single_1", "--num_samples", "2",
                "--out", str(tmp_path / "data")]
    argv = ["--data_dir", str(tmp_path / "data"), "--context_lengths", "400", "--datasets", "niah_single_1",
            "--method", "snapkv", "--max_capacity_prompts", "64", "--window_size", "8", "--max_new_tokens", "2",
            "--save_dir", str(tmp_path / "out")]
    ruler_data.main(generate)
    ruler.run([*argv, "--max_num_examples", "1"], model=tiny, tokenizer=tokenizer)
    ruler_data.main([*generate, "--seed", "7"])
    with pytest.raises(SystemExit, match="dataset 400/niah_single_1 was run on other data"):
        ruler.run(argv, model=tiny, tokenizer=tokenizer)


# ----------------------------------------------------------------------------- scripts


def test_run_script_generates_data_then_runs_with_valid_flags():
    from restkv.benchmarks.flags import parse_args, selected_datasets

    generate, run = dry_run_script("ruler/run.sh", "cpu", "snapkv", "128", "smollm2-135m", "--query_agnostic",
                             LENGTHS="4096 8192", NUM_SAMPLES="20")
    assert generate[:2] == ["-m", "restkv.benchmarks.ruler_data"]
    ruler_data.build_parser().parse_args(generate[2:])  # every flag exists
    assert generate[generate.index("--out") + 1] == "data/RULER/smollm2-135m"
    assert run[0] == "run_ruler.py"
    args = parse_args(ruler.BENCHMARK, run[1:], ruler.add_flags)
    assert args.context_lengths == [4096, 8192] and args.max_num_examples == 20 and args.query_agnostic
    assert args.method == "snapkv" and args.max_capacity_prompts == 128 and args.data_dir == "data/RULER/smollm2-135m"
    assert selected_datasets(args, ruler.BENCHMARK) == list(ruler.SYNTHETIC_TASKS)


def test_sweep_script_covers_budgets_and_methods(tmp_path):
    (tmp_path / "smollm2-135m").mkdir()
    lines = dry_run_script("ruler/sweep.sh", "cpu", "smollm2-135m", SAVE_DIR=str(tmp_path), BUDGETS="64 1024")
    runs = [line for line in lines if line[0] == "run_ruler.py"]
    settings = [(line[line.index("--method") + 1], line[line.index("--max_capacity_prompts") + 1]) for line in runs]
    assert settings[0] == ("fullkv", "0") and len(settings) == 1 + 2 * 4
    assert {("snapkv", "64"), ("restkv", "1024"), ("pyramidkv", "64"), ("streamingllm", "1024")} <= set(settings)
    assert all(line[line.index("--save_dir") + 1] == str(tmp_path) for line in runs)
    assert ["eval_ruler.py", "--results_dir", str(tmp_path / "smollm2-135m")] in lines
    assert lines[-1][:2] == ["visualization/visualize.py", "budget"]


def test_scripts_print_their_usage_without_arguments():
    for script in ("ruler/run.sh", "ruler/eval.sh", "ruler/sweep.sh"):
        code, message = usage_exit(script)
        assert code == 2 and "bash scripts/" + script in message


# ----------------------------------------------------------------------------- multi-question mode


@pytest.fixture(scope="module")
def niah_dir(tmp_path_factory):
    """RULER data at 600 tokens for SmolLM2: one niah task of each needle layout, two samples each."""
    out = tmp_path_factory.mktemp("niah_data")
    ruler_data.main(["--tokenizer", "smollm2-135m", "--lengths", "600", "--num_samples", "2", "--out", str(out),
                     "--tasks", "niah_single_1,niah_multikey_1,niah_multivalue,niah_multiquery"])
    return out


def multi_question_samples(data_dir, task):
    args = argparse.Namespace(data_dir=str(data_dir), chat_template=True, multi_question=True)
    return ruler.ruler_samples(args, f"600/{task}")


@pytest.mark.parametrize("task, questions, singular", [("niah_single_1", 1, True), ("niah_multikey_1", 4, True),
                                                       ("niah_multivalue", 1, False), ("niah_multiquery", 4, True)])
def test_multi_question_samples_ask_each_needle_in_rulers_wording(niah_dir, task, questions, singular):
    records = ruler.load_task(niah_dir, 600, task)
    for sample, record in zip(multi_question_samples(niah_dir, task), records, strict=True):
        context, file_question = ruler.split_question(task, record["input"])
        assert sample.context == context and sample.question == "" and len(sample.questions) == questions
        for question, needle in zip(sample.questions, record["needles"], strict=True):
            key, shown = needle["key"], "number" if singular else "numbers"
            assert question.fields == {"outputs": needle["values"]}
            if singular:
                assert question.text == f"\nWhat is the special magic {shown} for {key} mentioned in the provided text?"
                assert question.answer_prefix == f" The special magic {shown} for {key} mentioned in the provided text is"
            else:
                assert question.text == f"\nWhat are all the special magic {shown} for {key} mentioned in the " \
                                        "provided text?"
            if needle["values"] == record["outputs"]:  # the needle the file's own question asks about
                assert (question.text, question.answer_prefix) == (file_question, record["answer_prefix"])


def test_multi_question_needs_data_that_record_their_needles(niah_dir, tmp_path, no_model_loading):
    data = tmp_path / "official"
    (data / "600" / "niah_single_1").mkdir(parents=True)
    official = data / "600" / "niah_single_1" / "validation.jsonl"
    records = ruler.load_task(niah_dir, 600, "niah_single_1")
    official.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "needles"}) + "\n" for r in records))
    argv = ["--data_dir", str(data), "--context_lengths", "600", "--datasets", "niah_single_1", "--method", "fullkv",
            "--save_dir", str(tmp_path / "out")]
    single = argparse.Namespace(data_dir=str(data), chat_template=True, multi_question=False)
    assert len(ruler.ruler_samples(single, "600/niah_single_1")) == 2  # fine for single-question runs
    with pytest.raises(SystemExit) as stop:
        ruler.run([*argv, "--multi_question"])
    assert stop.value.code == (
        f"error: {official}: sample 0 has no 'needles' list of {{'key', 'values'}}, which --multi_question asks about "
        "(RULER's prepare.py and older restkv data do not record them); regenerate the file: python -m "
        f"restkv.data ruler --tokenizer MODEL --lengths 600 --tasks niah_single_1 --out {data}")


def test_multi_question_runs_the_niah_tasks_only(capsys, no_model_loading):
    with pytest.raises(SystemExit) as stop:
        ruler.run(["--method", "fullkv", "--multi_question", "--datasets", "niah_multikey_1,vt,cwe"])
    assert stop.value.code == 2
    assert ("--multi_question asks about each inserted needle, so it runs only the niah tasks (niah_single_1, "
            "niah_single_2, niah_single_3, niah_multikey_1, niah_multikey_2, niah_multikey_3, niah_multivalue, "
            "niah_multiquery); give --datasets without vt, cwe") in capsys.readouterr().err


def without_timing(records):
    return [{name: value for name, value in record.items() if name not in ("index", "seconds")} for record in records]


def test_a_multi_question_run_compresses_each_context_once_and_answers_each_needle_as_if_asked_alone(
        niah_dir, tmp_path, tiny, tokenizer, prefill_calls):
    tasks = ("niah_single_1", "niah_multikey_1")
    argv = ["--data_dir", str(niah_dir), "--context_lengths", "600", "--datasets", ",".join(tasks),
            "--method", "snapkv", "--max_capacity_prompts", "64", "--window_size", "8", "--max_new_tokens", "6",
            "--save_dir", str(tmp_path)]
    first = ruler.run([*argv, "--multi_question", "--max_num_examples", "1"], model=tiny, tokenizer=tokenizer)
    assert len(prefill_calls) == 2
    folder = ruler.run([*argv, "--multi_question"], model=tiny, tokenizer=tokenizer)  # resumes: second samples
    assert folder == first and folder.name == "snapkv_64_agnostic_multi"
    assert len(prefill_calls) == 2 + 2  # one compression per sample, not per question
    lines = {task: read_predictions(folder / "600", task) for task in tasks}
    multikey = lines["niah_multikey_1"]
    assert [r["id"] for r in multikey] == [f"{i}/{k}" for i in range(2) for k in range(4)]
    needles = [n for record in ruler.load_task(niah_dir, 600, "niah_multikey_1") for n in record["needles"]]
    assert [r["outputs"] for r in multikey] == [n["values"] for n in needles]
    assert all(r["question_tokens"] > 0 and r["kv_tokens_stored"] < r["kv_tokens_seen"] for r in multikey)

    meta = json.loads((folder / "run_meta.json").read_text())
    assert meta["settings"]["query_agnostic"] is True and meta["settings"]["benchmark_flags"]["multi_question"]
    assert meta["datasets"]["600/niah_multikey_1"]["samples_expected"] == 8
    assert meta["datasets"]["600/niah_single_1"]["samples_expected"] == 2
    scores = ruler.evaluate(["--results_dir", str(folder)])[folder][600]
    assert scores["niah_multikey_1"] == ruler.score_task("niah_multikey_1", [r["pred"] for r in multikey],
                                                         [r["outputs"] for r in multikey])
    written = json.loads((folder / "scores.json").read_text())["datasets"]["600/niah_multikey_1"]
    assert (written["samples_scored"], written["samples_expected"], written["complete"]) == (8, 8, True)

    # Every line is what its question gets alone, asked after a fresh compression of the context.
    singles = {f"600/{task}": [sample.single_question(k) for sample in multi_question_samples(niah_dir, task)
                               for k in range(len(sample.questions))] for task in tasks}
    alone = dataclasses.replace(ruler.BENCHMARK, load_samples=lambda args, dataset, tokenizer: singles[dataset])
    args = parse_args(alone, [*argv, "--query_agnostic", "--model_max_len", "600", "--tag", "alone"], ruler.add_flags)
    alone_folder = runner.run(alone, args, model=tiny, tokenizer=tokenizer, datasets=list(singles))
    assert len(prefill_calls) == 4 + 2 + 8
    for task in tasks:
        assert without_timing(lines[task]) == without_timing(read_predictions(alone_folder / "600", task))

    # The file's own question, asked query-agnostic, is the line of the needle it asks about.
    single = ruler.run([*argv, "--query_agnostic"], model=tiny, tokenizer=tokenizer)
    assert single.name == "snapkv_64_agnostic"  # a folder of its own
    for task in tasks:
        for plain in read_predictions(single / "600", task):
            (same,) = [r for r in lines[task] if r["index"] == plain["index"] and r["outputs"] == plain["outputs"]]
            assert without_timing([{**same, "id": plain["id"]}]) == without_timing([plain])


@pytest.mark.parametrize("method, allocation, mode", [
    (["--method", "snapkv", "--window_size", "8"], "uniform", []),
    (["--method", "snapkv", "--window_size", "8"], "uniform", ["--multi_question"]),
    (["--method", "restkv", "--window_size", "8"], "uniform", []),
    (["--method", "kvzip"], "model_ranked", []),
    (["--method", "kvzip", "--kvzip_layerwise"], "layer_ranked", ["--multi_question"]),
])
def test_run_ruler_with_reconstruction_observation_compresses_every_context_and_records_it(
        ruler_dir, tmp_path, tiny, tokenizer, reconstruction_run, method, allocation, mode):
    argv = ["--data_dir", str(ruler_dir), "--context_lengths", "600", "--datasets", "niah_single_1",
            *method, "--max_capacity_prompts", "64", "--max_new_tokens", "2", "--save_dir", str(tmp_path),
            *reconstruction_run.flags, *mode]
    folder = ruler.run(argv, model=tiny, tokenizer=tokenizer)
    records = read_predictions(folder / "600", "niah_single_1")
    assert len(records) == 2 and len(reconstruction_run.passes) == 2
    reconstruction_run.check(folder, records, tiny.config.num_hidden_layers, 64)
    config = json.loads((folder / "run_meta.json").read_text())["settings"]["config"]
    assert (config["method"], config["allocation"]) == (method[1], allocation)
    assert set(ruler.evaluate(["--results_dir", str(folder)])[folder][600]) == {"niah_single_1"}
