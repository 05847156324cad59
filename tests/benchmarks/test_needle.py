"""Needle-in-a-Haystack: grid, needle insertion, prompts, scorer, and the runner end to end."""

from __future__ import annotations

import json

import pytest
from top_level import dry_run_script, usage_exit

from restkv.benchmarks import needle
from restkv.benchmarks.haystack import HaystackText, load_essays
from restkv.benchmarks.results import read_predictions


def test_grid_matches_the_release():
    assert needle.depth_percents(10) == [0, 11, 22, 33, 44, 56, 67, 78, 89, 100]
    assert needle.depth_percents(1) == [0]
    assert needle.context_lengths(1000, 32001, 200)[:3] == [1000, 1200, 1400]
    assert len(needle.context_lengths(1000, 32001, 200)) == 156
    with pytest.raises(ValueError, match="--s_len"):
        needle.context_lengths(2000, 1000, 100)
    with pytest.raises(ValueError, match="intervals"):
        needle.depth_percents(0)


def test_insert_needle_keeps_the_budget_and_aligns_to_sentence_ends():
    haystack = list(range(1, 2001))  # ids divisible by 7 "end a sentence"
    needle_ids = [-1, -2, -3]
    is_end = lambda token: token % 7 == 0  # noqa: E731
    for depth in (0, 11, 50, 99, 100):
        ids = needle.insert_needle(haystack, needle_ids, 1000, depth, is_end)
        assert len(ids) == 1000 - needle.CONTEXT_BUFFER
        point = ids.index(-1)
        assert ids[point : point + 3] == needle_ids
        if depth == 100:
            assert point == len(ids) - 3
        elif depth == 0:
            assert point == 0
        else:
            assert is_end(ids[point - 1]) and point <= int(797 * depth / 100) < point + 7
    # A haystack shorter than the budget is used whole.
    assert needle.insert_needle(list(range(1, 101)), needle_ids, 1000, 100, is_end) == list(range(1, 101)) + needle_ids
    with pytest.raises(ValueError, match="no room for the needle"):
        needle.insert_needle(haystack, needle_ids, 202, 50, is_end)


def test_sentence_ends_come_from_the_tokenizer(tokenizer):
    ends = needle.SentenceEnds(tokenizer)
    period = tokenizer(".", add_special_tokens=False).input_ids[-1]
    word = tokenizer(" garden", add_special_tokens=False).input_ids[-1]
    assert ends(period) and not ends(word)


def test_prompts_have_the_needle_at_the_requested_length_and_depth(tokenizer):
    haystack = load_essays(None, min_words=3000)
    prompts = needle.build_prompts(tokenizer, haystack, [1000, 2000], [0, 50, 100])
    assert [(p.context_length, p.depth_percent) for p in prompts] == [
        (1000, 0), (1000, 50), (1000, 100), (2000, 0), (2000, 50), (2000, 100)]
    for prompt in prompts:
        assert prompt.context.startswith(needle.PROMPT_OPENING)
        assert prompt.question == " </book>.\n Based on the content of the book, Question: " \
            "The best thing to do in San Francisco is: \nAnswer:"
        body = prompt.context[len(needle.PROMPT_OPENING):]
        tokens = len(tokenizer(body, add_special_tokens=False).input_ids)
        assert abs(tokens - (prompt.context_length - needle.CONTEXT_BUFFER)) <= 3  # decode/encode round trip
        position = body.index(needle.NEEDLE.strip())
        relative = position / len(body)
        assert relative == pytest.approx(prompt.depth_percent / 100, abs=0.05)
    raw = needle.build_prompts(tokenizer, haystack, [1000], [50], chat=False)[0]
    assert raw.context.startswith("<|im_start|> This is a very long story book: <book> ")


def test_short_haystack_is_repeated(tokenizer):
    short = HaystackText("Short essay. It has two sentences. ", "tiny")
    ids = needle.haystack_ids(tokenizer, short, 500)
    assert len(ids) >= 500


def test_score_is_word_recall_of_the_expected_answer():
    assert needle.score_response("Eat a sandwich and sit in Dolores Park on a sunny day.") == 1.0
    assert needle.score_response("to EAT A SANDWICH") == pytest.approx(3 / 11)
    assert needle.score_response("") == 0.0
    assert needle.score_response("day") == 0.0  # "day." with its period is the expected word


def test_results_file_and_grid(tmp_path):
    records = [
        {"context_length": 1000, "depth_percent": 0, "pred": "eat a sandwich and sit in Dolores Park on a sunny day."},
        {"context_length": 1000, "depth_percent": 50, "pred": "nothing"},
        {"context_length": 2000, "depth_percent": 0, "pred": "sandwich"},
    ]
    rows = needle.score_records(records)
    results = needle.write_results(rows, tmp_path / "needle_results.json", model="m")
    assert results["mean_score"] == round((1 + 0 + 1 / 11) / 3, 4) and results["model"] == "m"
    assert needle.read_results(tmp_path / "needle_results.json") == rows
    depths, lengths, grid = needle.score_grid(rows)
    assert depths == [0, 50] and lengths == [1000, 2000]
    assert grid == [[1.0, pytest.approx(1 / 11)], [0.0, None]]
    with pytest.raises(ValueError, match="no needle results"):
        needle.write_results([], tmp_path / "empty.json")


@pytest.mark.embedded
def test_runner_end_to_end_with_resume(smollm2, tmp_path):
    model, tokenizer = smollm2
    argv = ["--model_path", "smollm2-135m", "--method", "fullkv", "--context_lengths", "700",
            "--depth_intervals", "2", "--save_dir", str(tmp_path)]
    folder = needle.run(argv + ["--max_num_examples", "1"], model=model, tokenizer=tokenizer)
    assert [r["id"] for r in read_predictions(folder, "needle")] == ["len_700_depth_0"]
    with open(folder / "needle.jsonl", "a") as handle:  # killed while writing the second cell
        handle.write('{"id": "len_700_depth_100", "pred": "eat')
    needle.run(argv, model=model, tokenizer=tokenizer)
    records = read_predictions(folder, "needle")
    assert [r["id"] for r in records] == ["len_700_depth_0", "len_700_depth_100"]
    assert all(r["haystack"] == "synthetic-prose" and r["new_tokens"] <= needle.MAX_NEW_TOKENS for r in records)
    results = json.loads((folder / "needle_results.json").read_text())
    assert [(c["context_length"], c["depth_percent"]) for c in results["cells"]] == [(700, 0), (700, 100)]
    # With the full cache SmolLM2 retrieves this needle (a regression in prompt building breaks it).
    assert results["mean_score"] > 0.5 and results["method"] == "fullkv"


def test_scripts_run_with_valid_flags_and_sweep(tmp_path):
    from restkv.benchmarks.flags import parse_args

    (run,) = dry_run_script("needle/run.sh", "0", "restkv", "128", "smollm2-135m", "--use_wo", E_LEN="4000")
    assert run[0] == "run_needle_in_haystack.py"
    args = parse_args(needle.BENCHMARK, run[1:], needle.add_flags)
    assert (args.s_len, args.e_len, args.step, args.depth_intervals) == (1000, 4000, 1000, 10)
    assert args.method == "restkv" and args.max_capacity_prompts == 128 and args.use_wo
    (tmp_path / "smollm2-135m").mkdir()
    (tmp_path / "smollm2-135m" / "needle_results.json").write_text("{}")
    lines = dry_run_script("needle/sweep.sh", "cpu", "smollm2-135m", SAVE_DIR=str(tmp_path), BUDGETS="128")
    methods = [line[line.index("--method") + 1] for line in lines if line[0] == "run_needle_in_haystack.py"]
    assert methods == ["fullkv", "snapkv", "pyramidkv", "streamingllm", "restkv"]
    results = str(tmp_path / "smollm2-135m" / "needle_results.json")
    assert ["visualization/visualize.py", "needle", "--results", results] in lines
    for script in ("needle/run.sh", "needle/eval.sh", "needle/sweep.sh"):
        code, message = usage_exit(script)
        assert code == 2 and "bash scripts/" + script in message


def test_release_flag_spellings_are_accepted():
    from restkv.benchmarks.flags import parse_args

    args = parse_args(needle.BENCHMARK, ["--model_name", "m", "--max_capacity_prompt", "96", "--method", "SnapKV",
                                         "--haystack_dir", "essays"], needle.add_flags)
    assert (args.model_path, args.max_capacity_prompts, args.method, args.data_dir) == ("m", 96, "snapkv", "essays")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--s_len", "2000", "--e_len", "1000"], "context lengths need 1 <= --s_len <= --e_len and --step >= 1"),
        (["--step", "0"], "--step >= 1"),
        (["--depth_intervals", "0"], "depths need intervals >= 1"),
        (["--context_lengths", "150", "900"], "--final_context_length_buffer 200 leaves no room for the haystack "
                                               "at context length 150"),
        (["--final_context_length_buffer", "-1"], "--final_context_length_buffer must be >= 0"),
    ],
)
def test_bad_grid_flags_stop_when_parsed(flags, message, capsys):
    from restkv.benchmarks.flags import parse_args

    with pytest.raises(SystemExit):
        parse_args(needle.BENCHMARK, ["--method", "fullkv", *flags], needle.add_flags)
    assert message in capsys.readouterr().err


def test_a_given_haystack_folder_must_hold_essays(no_model_loading, tmp_path):
    """A typo in --haystack_dir fell back to synthetic prose without a word."""
    argv = ["--method", "fullkv", "--context_lengths", "700", "--save_dir", str(tmp_path)]
    with pytest.raises(SystemExit, match=f"error: --haystack_dir {tmp_path / 'typo'}: no such folder"):
        needle.run([*argv, "--haystack_dir", str(tmp_path / "typo")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="holds no essays"):
        needle.run([*argv, "--data_dir", str(tmp_path / "empty")])
    assert not (tmp_path / "smollm2-135m").exists()



def test_a_query_agnostic_run_with_reconstruction_observation_compresses_every_context(
        tmp_path, tiny, tokenizer, reconstruction_run):
    argv = ["--method", "snapkv", "--max_capacity_prompts", "64", "--window_size", "8", "--context_lengths", "400",
            "--depth_intervals", "2", "--max_new_tokens", "2", "--save_dir", str(tmp_path), *reconstruction_run.flags]
    folder = needle.run(argv, model=tiny, tokenizer=tokenizer)
    records = read_predictions(folder, "needle")
    assert [r["id"] for r in records] == ["len_400_depth_0", "len_400_depth_100"]
    assert len(reconstruction_run.passes) == 2
    reconstruction_run.check(folder, records, tiny.config.num_hidden_layers, 64)
    results = json.loads((folder / "needle_results.json").read_text())
    assert len(results["cells"]) == 2 and json.loads((folder / "scores.json").read_text())["complete"] is True
    # The whole config and the mode, as run_meta.json has them (it once recorded only method and budget).
    settings = json.loads((folder / "run_meta.json").read_text())["settings"]
    assert results["config"] == settings["config"] and results["config"]["observation"] == "reconstruction"
    assert results["query_agnostic"] is True and results["method"] == "snapkv" and results["budget"] == 64
