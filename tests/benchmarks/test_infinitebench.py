"""InfiniteBench: official prompts and metrics on fixtures, truncation, runner and eval end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from top_level import dry_run_script, usage_exit

from restkv.benchmarks import infinitebench as ib
from restkv.benchmarks.benchmark import Sample
from restkv.benchmarks.errors import DataError
from restkv.benchmarks.prompts import encode_prompt
from restkv.benchmarks.results import read_predictions

FIXTURES = Path(__file__).resolve().parents[2] / "data" / "fixtures" / "infinitebench"


@pytest.mark.parametrize("task", list(ib.TASKS))
def test_fixture_prompts_follow_the_official_templates(task):
    examples = ib.load_task(FIXTURES, task)
    assert len(examples) == 2
    for example in examples:
        context, question = ib.build_prompt(example, task)
        prompt = context + question
        assert context.endswith(example["context"]) and "{" + "context" + "}" not in prompt
        head, tail = ib.get_task(task).template.split("{context}")
        assert prompt.startswith(head.split("{")[0]) and prompt.endswith(tail.rsplit("}", 1)[-1])


def test_task_specific_fields():
    code_run = ib.load_task(FIXTURES, "code_run")[0]
    _, question = ib.build_prompt(code_run, "code_run")
    assert question == "\n\nPlease compute the exact value of func_1(4). The value of func_1(4) is"
    context, _ = ib.build_prompt(code_run, "code_run")
    assert context.startswith("There is a function called func_1 in the following Python code.")
    math_find = ib.load_task(FIXTURES, "math_find")[0]
    prefix = "What is the largest number in the following list?\n\n"
    assert ib.build_prompt(math_find, "math_find")[0].startswith(prefix)
    choice = ib.load_task(FIXTURES, "longbook_choice_eng")[0]
    _, question = ib.build_prompt(choice, "longbook_choice_eng")
    assert "\nA. Swan\nB. Heron\nC. Gull\nD. Crane\n\nThe letter of the correct answer is" in question


def test_choice_labels_are_text_and_letter():
    first, second = ib.load_task(FIXTURES, "code_debug")
    assert ib.get_answer(first, "code_debug") == ["parse", "B"]
    assert ib.get_answer(second, "code_debug") == ["parse", "D"]
    assert ib.get_answer({"answer": ["x", "C"], "options": list("abcd")}, "longbook_choice_eng") == ["x", "C"]
    with pytest.raises(ValueError, match="not one of its options"):
        ib.get_answer({"answer": "zzz", "options": list("abcd"), "id": 3}, "code_debug")
    assert ib.get_answer({"answer": "71432"}, "passkey") == "71432"


def test_bad_data_is_reported(tmp_path):
    (tmp_path / "passkey.jsonl").write_text(json.dumps({"id": 0, "context": "c"}) + "\n")
    with pytest.raises(ValueError, match=r"passkey.jsonl:1: missing field\(s\) input, answer"):
        ib.load_task(tmp_path, "passkey")
    with pytest.raises(DataError, match="kv_retrieval.jsonl: no such data file.*xinrongzhang2022/InfiniteBench"):
        ib.load_task(tmp_path, "kv_retrieval")
    with pytest.raises(ValueError, match="unknown InfiniteBench task"):
        ib.load_task(tmp_path, "passkeys")


@pytest.mark.parametrize(
    "task, prediction, label, expected",
    [
        ("passkey", " 71432. The pass key", "71432", 1.0),
        ("passkey", "key 7143", ["71432"], 0.0),
        ("number_string", "is 4820193746", ["4820193746"], 1.0),
        ("kv_retrieval", 'The value is "e5a0-77".', "e5a0-77", 1.0),
        ("kv_retrieval", "e5a0-7", "e5a0-77", 0.0),
        ("code_run", " 14.", 14, 1.0),
        ("code_run", "func_0(-5) is -2", [-2], 1.0),
        ("code_run", "fourteen", 14, 0.0),
        ("code_debug", "B. parse", ["parse", "B"], 1.0),
        ("code_debug", "The correct option is: parse", ["parse", "B"], 1.0),
        ("code_debug", "The answer is: A", ["parse", "B"], 0.0),
        ("code_debug", "parse", ["parse", "B"], 0.0),
        ("math_find", " 93", 93, 1.0),
        ("math_find", "9.5", 9.5, 1.0),
        ("math_find", "none", [2], 0.0),
        ("math_calc", "[5, 8, 7, 16]", [5, 8, 6, 16], 0.5),
        ("math_calc", "5, 8, 6, 16", [[5, 8, 6, 16]], 1.0),
        ("longdialogue_qa_eng", "Mary, of course.", ["MARY"], 1.0),
        ("longdialogue_qa_eng", "Maryann", ["MARY"], 0.0),
        ("longbook_choice_eng", "B", ["Heron", "B"], 1.0),
        ("longbook_choice_eng", "Heron", ["Heron", "B"], 1.0),
        ("longbook_choice_eng", "the answer is B.", ["Heron", "B"], 1.0),
        ("longbook_choice_eng", "the option is C", ["Heron", "B"], 0.0),
        ("longbook_choice_eng", "I think C is right", ["Heron", "B"], 0.0),
        ("longbook_qa_eng", "The captain Tobin", ["Tobin", "Captain Tobin"], 1.0),
        ("longbook_qa_eng", "Tobin the sailor", ["Tobin"], pytest.approx(2 * 0.5 * 1 / 1.5)),
        ("longbook_qa_chn", "白鹭。", ["白鹭"], 1.0),
        ("longbook_qa_chn", "白色", ["白鹭"], 0.5),
    ],
)
def test_official_scorers(task, prediction, label, expected):
    assert ib.get_task(task).scorer(prediction, label) == expected


def test_rouge_lsum_matches_hand_computation():
    # Reference sentences [the cat sat] [the dog ran], candidate [the cat ran]: union-LCS hits
    # "the", "cat" (sentence 1) and "ran" (sentence 2); recall 3/6, precision 3/3.
    assert ib.rouge_lsum_f1("The cat ran!", "the cat sat\nthe dog ran") == pytest.approx(2 / 3)
    assert ib.rouge_lsum_f1("Same words here.", "same words here") == 1.0
    assert ib.rouge_lsum_f1("", "a b") == 0.0 and ib.rouge_lsum_f1("x y", "a b") == 0.0
    assert ib.score_task("longbook_sum_eng", ["the cat ran", "a b"], [["the cat sat\nthe dog ran"], ["a b"]]) == 83.33


def test_eval_marks_tasks_scored_on_fewer_samples_than_expected(tmp_path, capsys):
    run = tmp_path / "snapkv_64"
    rows = [{"id": "0", "index": 0, "pred": "71432", "ground_truth": "71432"}]
    run.mkdir()
    (run / "passkey.jsonl").write_text(json.dumps(rows[0]) + "\n")
    expected = {"fingerprint": "0" * 64, "samples_in_data": 2, "samples_expected": 2}
    (run / "run_meta.json").write_text(json.dumps({"settings": {"benchmark": "infinite_bench"},
                                                   "datasets": {"passkey": expected}}))
    assert ib.evaluate(["--results_dir", str(tmp_path)]) == {run: {"passkey": 100.0, "Avg": 100.0}}
    output = capsys.readouterr().out.splitlines()
    assert output[1].split() == ["snapkv_64", "100.00*", "100.00*", "1/2"]
    assert "* snapkv_64 / passkey: 1/2 samples" in output


def test_truncation_keeps_both_ends_of_the_prompt():
    from restkv.integrations.transformers.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    example = ib.load_task(FIXTURES, "passkey")[0]
    context, question = ib.build_prompt(example, "passkey")
    sample = Sample(id="0", context=context, question=question, max_new_tokens=6, chat=False)
    encoded = encode_prompt(tokenizer, sample, 120)
    text = tokenizer.decode(encoded.context_ids)
    assert encoded.truncated and encoded.num_tokens <= 121
    assert text.startswith("There is an important info hidden")
    assert text.endswith("What is the pass key?\n\nThe pass key is")
    assert not encode_prompt(tokenizer, sample, 5000).truncated


@pytest.mark.embedded
def test_runner_shards_and_eval_end_to_end(smollm2, tmp_path):
    model, tokenizer = smollm2
    argv = ["--model_path", "smollm2-135m", "--method", "snapkv", "--max_capacity_prompts", "64",
            "--data_dir", str(FIXTURES), "--datasets", "passkey"]
    whole = ib.run(argv + ["--save_dir", str(tmp_path / "whole")], model=model, tokenizer=tokenizer)
    for shard in ("0", "1"):
        sharded = ib.run(argv + ["--save_dir", str(tmp_path / "sharded"), "--num_shards", "2", "--shard_id", shard],
                         model=model, tokenizer=tokenizer)
    records = read_predictions(whole, "passkey")
    assert [r["ground_truth"] for r in records] == ["71432", "20958"]
    assert all(r["new_tokens"] <= 6 and r["kv_tokens_stored"] < r["kv_tokens_seen"] for r in records)
    merged = read_predictions(sharded, "passkey")
    assert [(r["id"], r["pred"]) for r in merged] == [(r["id"], r["pred"]) for r in records]
    results = ib.evaluate(["--results_dir", str(tmp_path)])
    expected = ib.score_task("passkey", [r["pred"] for r in records], [r["ground_truth"] for r in records])
    assert results[whole] == results[sharded] == {"passkey": expected, "Avg": expected}
    assert json.loads((whole / "infinite_scores.json").read_text()) == results[whole]


def test_scripts_run_with_valid_flags_and_sweep(tmp_path):
    from restkv.benchmarks.flags import parse_args, selected_datasets

    (run,) = dry_run_script("infinite_bench/run.sh", "0", "snapkv", "1024", "some/Llama-3.1-8B-Instruct",
                            "--generation_lengths", "release")
    assert run[0] == "run_infinite_bench.py"
    args = parse_args(ib.BENCHMARK, run[1:], ib.add_flags)
    assert selected_datasets(args, ib.BENCHMARK) == list(ib.TASKS)
    assert args.generation_lengths == "release" and args.data_dir == "data/InfiniteBench"
    (tmp_path / "Llama-3.1-8B-Instruct").mkdir()
    lines = dry_run_script("infinite_bench/sweep.sh", "0", "some/Llama-3.1-8B-Instruct", SAVE_DIR=str(tmp_path),
                           BUDGETS="1024")
    runs = [line for line in lines if line[0] == "run_infinite_bench.py"]
    assert [line[line.index("--method") + 1] for line in runs] == ["fullkv", "snapkv", "restkv"]
    assert runs[-1][runs[-1].index("--kernel_size") + 1] == "21"
    assert ["eval_infinite.py", "--results_dir", str(tmp_path / "Llama-3.1-8B-Instruct")] in lines
    for script in ("infinite_bench/run.sh", "infinite_bench/eval.sh", "infinite_bench/sweep.sh"):
        code, message = usage_exit(script)
        assert code == 2 and "bash scripts/" + script in message


def test_generation_lengths_official_and_release():
    from restkv.benchmarks.flags import parse_args

    for table, expected in (("official", 6), ("release", 15)):
        args = parse_args(ib.BENCHMARK, ["--data_dir", str(FIXTURES), "--generation_lengths", table,
                                         "--method", "fullkv"], ib.add_flags)
        samples = ib.infinite_samples(args, "passkey")
        assert [s.max_new_tokens for s in samples] == [expected, expected] and not samples[0].chat
        assert samples[0].fields == {"ground_truth": "71432", "dataset": "passkey"} and samples[0].id == "0"
