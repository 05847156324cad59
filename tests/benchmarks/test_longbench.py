"""LongBench adapter: official prompts, fixture data, truncation, evaluation, end-to-end runs."""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
from pathlib import Path

import pytest

from restkv.benchmarks import longbench
from restkv.benchmarks.errors import DataError
from restkv.benchmarks.prompts import encode_prompt
from restkv.benchmarks.results import read_predictions

FIXTURES = Path(__file__).resolve().parents[2] / "data" / "fixtures" / "LongBench"


def fixture_records(dataset):
    return longbench.read_records(FIXTURES / f"{dataset}.jsonl")


# ------------------------------------------------------------------------------- benchmark facts


def test_templates_are_the_official_file_byte_for_byte():
    """sha256 of LongBench/config/dataset2prompt.json (THUDM/LongBench 2e00731), parsed and re-serialised."""
    serialised = json.dumps(longbench.PROMPTS, ensure_ascii=False, sort_keys=True).encode("utf-8")
    assert hashlib.sha256(serialised).hexdigest() == "e7d865d712fe45e2455f5e864ac474001d7758d68d349e76ffbcdd382483358f"
    assert "asconcisely" in longbench.PROMPTS["narrativeqa"]  # the official typo stays
    assert longbench.PROMPTS["passage_count"].endswith("The final answer is: ")
    assert longbench.PROMPTS["lcc"].endswith("Next line of code:\n")
    assert longbench.PROMPTS["multifieldqa_zh"].endswith("回答：")


def test_dataset_tables():
    assert len(longbench.ENGLISH_DATASETS) == 16 and len(longbench.DATASETS) == 21
    assert set(longbench.PROMPTS) == set(longbench.MAX_NEW_TOKENS) == set(longbench.DATASETS)
    assert longbench.MAX_NEW_TOKENS["gov_report"] == 512 and longbench.MAX_NEW_TOKENS["hotpotqa"] == 32
    assert longbench.BENCHMARK.default_datasets == longbench.ENGLISH_DATASETS
    assert "qasper_e" in longbench.BENCHMARK.datasets and len(longbench.ALL_DATASETS) == 21 + 13


# ------------------------------------------------------------------------------- data and prompts


@pytest.mark.parametrize("dataset", longbench.DATASETS + ("qasper_e",))
def test_fixtures_have_the_official_format_and_prompts(dataset):
    records = fixture_records(dataset)
    assert len(records) >= 2
    for record in records:
        context, question = longbench.prompt_parts(dataset, record)
        assert context + question == longbench.PROMPTS[longbench.base_dataset(dataset)].format(**record)
        assert context.endswith(record["context"]) and record["input"] in question
        sample = longbench.to_sample(dataset, record)
        assert sample.id == record["_id"] and sample.fields["answers"] == record["answers"]
        assert sample.max_new_tokens == longbench.MAX_NEW_TOKENS[longbench.base_dataset(dataset)]


def test_chat_template_and_stop_rules():
    raw = {name for name in longbench.DATASETS if not longbench.to_sample(name, fixture_records(name)[0]).chat}
    assert raw == {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
    samsum = longbench.to_sample("samsum", fixture_records("samsum")[0])
    assert samsum.stop_tokens == ("\n",) and samsum.min_new_tokens == 1
    assert longbench.to_sample("qasper", fixture_records("qasper")[0]).stop_tokens == ()


def test_prompts_on_fixtures_are_cut_in_the_middle(tokenizer):
    record = fixture_records("narrativeqa")[0]
    sample = longbench.to_sample("narrativeqa", record)
    full = encode_prompt(tokenizer, sample, 4000)
    cut = encode_prompt(tokenizer, sample, 100)
    assert not full.truncated and cut.truncated and cut.num_tokens < full.num_tokens
    text = tokenizer.decode(cut.context_ids)
    assert "You are given a story" in text and text.endswith("Answer:<|im_end|>\n<|im_start|>assistant\n")
    assert "barley soup" not in text  # the middle of the story went
    raw = encode_prompt(tokenizer, longbench.to_sample("lcc", fixture_records("lcc")[0]), 40)
    assert tokenizer.decode(raw.context_ids).startswith("Please complete the code")
    assert tokenizer.decode(raw.context_ids).endswith("Next line of code:\n")


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"input": "q"\n', "bad.jsonl:1: not valid JSON"),
        ('[1, 2]\n', "bad.jsonl:1: expected a JSON object"),
        ("{good}\n{drop}\n", "bad.jsonl:2: missing field 'answers'"),
        ("{good}\n{length_as_text}\n", "bad.jsonl:2: field 'length' has type str, expected int"),
        ("{classes_as_text}\n", "bad.jsonl:1: field 'all_classes' has type str, expected list or null"),
    ],
)
def test_malformed_data_names_file_line_and_field(tmp_path, content, message):
    good = fixture_records("qasper")[0]
    content = (
        content.replace("{good}", json.dumps(good))
        .replace("{drop}", json.dumps({k: v for k, v in good.items() if k != "answers"}))
        .replace("{length_as_text}", json.dumps({**good, "length": "12"}))
        .replace("{classes_as_text}", json.dumps({**good, "all_classes": "Food"}))
    )
    (tmp_path / "bad.jsonl").write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match=message.replace("(", r"\(")):
        longbench.read_records(tmp_path / "bad.jsonl")


def test_missing_data_file_and_unknown_dataset(tmp_path):
    with pytest.raises(DataError, match="no such data file"):
        longbench.load_samples(argparse.Namespace(data_dir=str(tmp_path)), "qasper")
    with pytest.raises(DataError, match="unknown LongBench dataset 'qasperr'"):
        longbench.base_dataset("qasperr")


# ------------------------------------------------------------------------------- evaluation


def write_predictions(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")


def prediction(index, pred, answers, length=100, all_classes=None):
    return {"id": f"s{index}", "index": index, "pred": pred, "answers": answers, "all_classes": all_classes,
            "length": length}


def test_eval_scores_every_run_and_merges_shards(tmp_path, capsys):
    root = tmp_path / "smollm2-135m"
    hotpot = [prediction(0, "Vienna", ["Vienna"]), prediction(1, "in Paris", ["Paris"], 5000),
              prediction(2, "no", ["Tennessee"], 9000)]
    trec = [prediction(0, "Food\nDate", ["Food"], all_classes=["Food", "Date"]),
            prediction(1, "Date", ["Food"], all_classes=["Food", "Date"])]
    write_predictions(root / "snapkv_64" / "hotpotqa.jsonl", hotpot)
    write_predictions(root / "snapkv_64" / "trec.jsonl", trec)
    write_predictions(root / "fullkv" / "hotpotqa.shard-0-of-2.jsonl", [hotpot[0], hotpot[2]])
    write_predictions(root / "fullkv" / "hotpotqa.shard-1-of-2.jsonl", [hotpot[1]])
    evaluations = longbench.evaluate(["--results_dir", str(root), "--buckets"])

    snap = evaluations["snapkv_64"]
    expected_hotpot = longbench.scorer("hotpotqa", [r["pred"] for r in hotpot], [r["answers"] for r in hotpot], None)
    assert snap["datasets"]["hotpotqa"]["score"] == expected_hotpot == 55.56
    assert snap["datasets"]["trec"]["score"] == 50.0
    assert snap["average"] == round((55.56 + 50.0) / 2, 2)
    assert snap["datasets"]["hotpotqa"]["buckets"] == {"0-4k": 100.0, "4-8k": 66.67, "8k+": 0.0}
    assert evaluations["fullkv"]["datasets"]["hotpotqa"]["score"] == expected_hotpot  # merged shards
    assert evaluations["fullkv"]["datasets"]["hotpotqa"]["samples"] == 3

    output = capsys.readouterr().out
    assert "hotpotqa" in output and "LongBench-E length buckets" in output
    assert "no average for runs missing a dataset: fullkv" in output
    with open(root / "results.csv", encoding="utf-8") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["run", "hotpotqa", "trec", "average"]
    assert ["snapkv_64", "55.56", "50.0", "52.78"] in rows and ["fullkv", "55.56", "", ""] in rows
    assert json.loads((root / "snapkv_64" / "metrics.json").read_text())["average"] == 52.78
    assert set(json.loads((root / "results.json").read_text())) == {"fullkv", "snapkv_64"}


def test_eval_marks_a_dataset_scored_on_fewer_samples_than_expected(tmp_path, capsys):
    """A run that stopped after 3 of its 6 samples must not pass for a complete one."""
    run = tmp_path / "smollm2-135m" / "snapkv_64"
    write_predictions(run / "hotpotqa.jsonl", [prediction(i, "Vienna", ["Vienna"]) for i in range(3)])
    expected = {"fingerprint": "0" * 64, "samples_in_data": 6, "samples_expected": 6}
    (run / "run_meta.json").write_text(json.dumps({"settings": {"benchmark": "longbench"},
                                                   "datasets": {"hotpotqa": expected}}))
    evaluations = longbench.evaluate(["--results_dir", str(tmp_path / "smollm2-135m")])
    output = capsys.readouterr().out
    assert output.splitlines()[1].split() == ["snapkv_64", "100.00*", "100.00*", "3/6"]
    assert "* snapkv_64 / hotpotqa: 3/6 samples" in output
    assert evaluations["snapkv_64"]["datasets"]["hotpotqa"]["samples"] == 3
    scores = json.loads((run / "scores.json").read_text())
    assert scores["datasets"]["hotpotqa"]["samples_scored"] == 3 and scores["complete"] is False


def test_eval_reads_official_prediction_files(tmp_path):
    """pred/<model>/<dataset>.jsonl of LongBench's pred.py scores as the official eval.py would."""
    lines = [{"pred": "Paragraph 3", "answers": ["Paragraph 3"], "all_classes": None, "length": 10},
             {"pred": "Paragraphs 3 and 4", "answers": ["Paragraph 4"], "all_classes": None, "length": 10}]
    write_predictions(tmp_path / "passage_retrieval_en.jsonl", lines)
    result = longbench.evaluate_results_dir(tmp_path)
    assert result[tmp_path.name]["datasets"]["passage_retrieval_en"]["score"] == 75.0


def test_eval_stops_on_unknown_datasets_and_missing_fields(tmp_path):
    write_predictions(tmp_path / "run" / "notes.jsonl", [prediction(0, "x", ["x"])])
    with pytest.raises(DataError, match="unknown LongBench dataset 'notes'"):
        longbench.evaluate_results_dir(tmp_path / "run")
    write_predictions(tmp_path / "other" / "qasper.jsonl", [{"id": "a", "answers": ["x"], "all_classes": None}])
    with pytest.raises(DataError, match="lacks field 'pred'"):
        longbench.evaluate_results_dir(tmp_path / "other")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no prediction files"):
        longbench.evaluate(["--results_dir", str(tmp_path / "empty")])


# ------------------------------------------------------------------------------- end to end (embedded model)


@pytest.mark.embedded
def test_run_longbench_end_to_end_then_eval(tmp_path, smollm2):
    """Query-aware on samsum (raw prompt, newline stop) and, query-agnostic, on hotpotqa (chat,
    prompts cut to 120 tokens)."""
    model, tokenizer = smollm2
    common = ["--data_dir", str(FIXTURES), "--save_dir", str(tmp_path), "--method", "snapkv",
              "--max_capacity_prompts", "64", "--window_size", "16", "--max_num_examples", "2"]
    aware = longbench.run([*common, "--dataset", "samsum", "--max_new_tokens", "6"], model=model, tokenizer=tokenizer)
    agnostic = longbench.run([*common, "--dataset", "hotpotqa", "--max_new_tokens", "4", "--query_agnostic",
                              "--model_max_len", "120"], model=model, tokenizer=tokenizer)
    samsum = read_predictions(aware, "samsum")
    hotpot = read_predictions(agnostic, "hotpotqa")
    assert len(samsum) == len(hotpot) == 2
    for record in samsum + hotpot:
        assert record["prompt_tokens"] > 64 and record["kv_layers_compressed"] == model.config.num_hidden_layers
        assert 1 <= record["new_tokens"] <= 6
    assert all("\n" not in record["pred"] for record in samsum)  # stopped at the newline
    assert all(record["question_tokens"] > 0 and record["truncated"] for record in hotpot)
    assert not any(record["truncated"] for record in samsum)
    assert [r["answers"] for r in samsum] == [r["answers"] for r in fixture_records("samsum")]

    evaluations = longbench.evaluate(["--results_dir", str(tmp_path / "smollm2-135m")])
    expected = longbench.scorer("samsum", [r["pred"] for r in samsum], [r["answers"] for r in samsum], None)
    assert evaluations["snapkv_64"]["datasets"]["samsum"]["score"] == expected
    assert not math.isnan(evaluations["snapkv_64_agnostic"]["average"])


def test_a_query_agnostic_run_with_reconstruction_observation_compresses_every_context(
        tmp_path, tiny, tokenizer, reconstruction_run):
    argv = ["--data_dir", str(FIXTURES), "--dataset", "hotpotqa", "--save_dir", str(tmp_path), "--method", "snapkv",
            "--max_capacity_prompts", "64", "--window_size", "8", "--max_num_examples", "2", "--max_new_tokens", "2",
            *reconstruction_run.flags]
    folder = longbench.run(argv, model=tiny, tokenizer=tokenizer)
    records = read_predictions(folder, "hotpotqa")
    assert len(records) == 2 and len(reconstruction_run.passes) == 2
    reconstruction_run.check(folder, records, tiny.config.num_hidden_layers, 64)
    evaluations = longbench.evaluate_results_dir(folder)
    assert evaluations[folder.name]["datasets"]["hotpotqa"]["samples"] == 2


def test_scripts_run_with_valid_flags_and_sweep(tmp_path):
    """scripts/longbench/{run,sweep,eval}.sh, as the other benchmarks' scripts are checked: the
    runner's command line they build parses, the sweep covers every method and budget, then scores."""
    from top_level import dry_run_script, usage_exit

    from restkv.benchmarks.flags import parse_args, selected_datasets

    (run,) = dry_run_script("longbench/run.sh", "cpu", "snapkv", "128", "smollm2-135m", "--query_agnostic")
    assert run[0] == "run_longbench.py"
    args = parse_args(longbench.BENCHMARK, run[1:])
    assert args.method == "snapkv" and args.max_capacity_prompts == 128 and args.query_agnostic
    assert len(selected_datasets(args, longbench.BENCHMARK)) == 16 and args.data_dir == "data/LongBench"
    (tmp_path / "smollm2-135m").mkdir()
    lines = dry_run_script("longbench/sweep.sh", "cpu", "smollm2-135m", SAVE_DIR=str(tmp_path), BUDGETS="64")
    runs = [line for line in lines if line[0] == "run_longbench.py"]
    assert [line[line.index("--method") + 1] for line in runs] == ["fullkv", "streamingllm", "h2o", "snapkv",
                                                                    "pyramidkv", "restkv"]
    assert ["eval.py", "--results_dir", str(tmp_path / "smollm2-135m")] in lines
    for script in ("longbench/run.sh", "longbench/eval.sh", "longbench/sweep.sh"):
        code, message = usage_exit(script)
        assert code == 2 and "bash scripts/" + script in message
