"""The offline RULER generator: official format, answers in the context, target length, determinism."""

from __future__ import annotations

import collections
import json
import math
import re

import pytest

from restkv.benchmarks import ruler, ruler_data
from restkv.benchmarks.haystack import SYNTHETIC_SOURCE, load_essays, split_sentences, synthetic_prose
from restkv.benchmarks.ruler_data import generate_task, largest_fitting_size

RULER_FIELDS = ["index", "input", "outputs", "length", "length_w_model_temp", "answer_prefix"]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from restkv.integrations.transformers.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def samples_8k(smollm2_tokenizer):
    """Two samples of each offline task at 8K tokens (about 10 s on one CPU core)."""
    return {task: generate_task(task, 8192, 2, smollm2_tokenizer) for task in ruler.SYNTHETIC_TASKS}


def recount(tokenizer, sample, use_chat_template=True) -> int:
    prompt = ruler.build_prompt(sample, tokenizer, use_chat_template)
    return len(tokenizer(prompt, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("task", ruler.SYNTHETIC_TASKS)
def test_official_format(samples_8k, task):
    for number, sample in enumerate(samples_8k[task]):
        expected = RULER_FIELDS + (["token_position_answer", "needles"] if task.startswith("niah") else [])
        assert list(sample) == expected
        assert sample["index"] == number
        assert isinstance(sample["outputs"], list) and all(isinstance(o, str) and o for o in sample["outputs"])
        family = ruler.get_task(task).family
        # RULER locates the prefix by its first 10 characters; the input must not contain it at the end.
        assert sample["answer_prefix"].startswith(family.answer_prefix[:10])
        assert not sample["input"].endswith(sample["answer_prefix"])
        json.dumps(sample)  # serialisable as one jsonl line


@pytest.mark.parametrize("task", ruler.SYNTHETIC_TASKS)
def test_hits_target_length_within_one_percent(samples_8k, smollm2_tokenizer, task):
    to_generate = ruler.get_task(task).tokens_to_generate
    for sample in samples_8k[task]:
        total = sample["length_w_model_temp"]
        assert 0.99 * 8192 <= total <= 8192
        # The recorded lengths are what the tokenizer says about the prompt the runner sends.
        assert recount(smollm2_tokenizer, sample) + to_generate == total
        bare = len(smollm2_tokenizer(sample["input"] + sample["answer_prefix"], add_special_tokens=False).input_ids)
        assert sample["length"] == bare + to_generate < total  # the chat template costs tokens


@pytest.mark.parametrize("task", [t for t in ruler.SYNTHETIC_TASKS if t.startswith("niah")])
def test_niah_answers_are_needles_in_the_context(samples_8k, task):
    args = ruler.get_task(task).args
    for sample in samples_8k[task]:
        text = sample["input"]
        plural = args["num_needle_v"] * args["num_needle_q"] > 1
        assert text.startswith("Some special magic" if plural else "A special magic")
        queries = re.search(r"special magic \w+ for (.+) mentioned in the provided text\?$", text).group(1)
        keys = re.split(r", and |, ", queries)
        assert len(keys) == args["num_needle_q"]
        assert len(sample["outputs"]) == args["num_needle_q"] * args["num_needle_v"]
        found = []
        for key in keys:
            values = re.findall(rf"One of the special magic \w+ for {re.escape(key)} is: (\S+)\.", text)
            assert len(values) == args["num_needle_v"]
            found += values
        assert sorted(found) == sorted(sample["outputs"])
        assert text.find(sample["outputs"][0]) >= 0 and sample["token_position_answer"] > 0
        # Every needle inserted is recorded, the queried ones and the others.
        needles = sample["needles"]
        assert len(needles) == max(args["num_needle_k"], args["num_needle_q"])
        assert {n["key"] for n in needles} >= set(keys) and len({n["key"] for n in needles}) == len(needles)
        for needle in needles:
            inserted = re.findall(rf"One of the special magic \w+ for {re.escape(needle['key'])} is: (\S+)\.", text)
            assert sorted(needle["values"]) == sorted(inserted) and len(inserted) == args["num_needle_v"]
        assert sorted(v for n in needles if n["key"] in keys for v in n["values"]) == sorted(sample["outputs"])


def test_vt_answer_is_the_chain_of_the_queried_value(samples_8k):
    for sample in samples_8k["vt"]:
        value = re.search(r"assigned the value (\d+), they are: $", sample["answer_prefix"]).group(1)
        question_start = sample["input"].rindex("Memorize and track")  # after the solved example
        task_text = sample["input"][question_start:]
        assignments = dict(re.findall(r"VAR (\w+) = (VAR \w+|\d+)", task_text))
        holders = {name for name, rhs in assignments.items() if rhs == value}
        grown = True
        while grown:
            new = {name for name, rhs in assignments.items() if rhs.removeprefix("VAR ") in holders}
            grown = not new <= holders
            holders |= new
        assert sorted(holders) == sorted(sample["outputs"]) and len(holders) == 5
        assert sample["input"].count("Answer: According to the chain(s)") == 1  # the few-shot example


def test_cwe_answer_is_the_ten_most_common_words(samples_8k):
    for sample in samples_8k["cwe"]:
        task_list = sample["input"].rsplit("Memorize the ones that appear most often.\n", 1)[1]
        words = re.findall(r"\d+\. (.+?)(?= \d+\. |\nQuestion:)", task_list)
        counts = collections.Counter(words)
        top = [w for w, c in counts.items() if c == 30]
        assert sorted(top) == sorted(sample["outputs"]) and len(top) == 10
        assert set(counts.values()) == {30, 3}


def test_fwe_answer_is_the_three_most_frequent_coded_words(samples_8k):
    for sample in samples_8k["fwe"]:
        coded = sample["input"].split("coded words. ", 1)[1].split("\nQuestion:")[0].split()
        ranking = [w for w, _ in collections.Counter(coded).most_common() if w != "..."]
        assert ranking[:3] == sample["outputs"]
        assert collections.Counter(coded).most_common(1)[0][0] == "..."


def test_deterministic_per_seed_and_per_sample(smollm2_tokenizer):
    first = generate_task("niah_multikey_2", 1024, 2, smollm2_tokenizer, seed=7)
    assert generate_task("niah_multikey_2", 1024, 2, smollm2_tokenizer, seed=7) == first
    assert generate_task("niah_multikey_2", 1024, 2, smollm2_tokenizer, seed=8) != first
    # A sample does not depend on how many were generated before it.
    assert generate_task("niah_multikey_2", 1024, 1, smollm2_tokenizer, seed=7, first_index=1) == first[1:]


def test_base_tokenizer_counts_no_template():
    from restkv.integrations.transformers.models import load_tokenizer

    gemma = load_tokenizer("gemma3-270m")
    (sample,) = generate_task("niah_single_1", 2048, 1, gemma)
    assert sample["length"] == sample["length_w_model_temp"]
    assert 0.98 * 2048 <= sample["length"] <= 2048  # one noise line is ~1% of 2K tokens


def test_too_short_target_is_a_clear_error(smollm2_tokenizer):
    with pytest.raises(ValueError, match="niah_single_1 cannot fit 200 tokens"):
        generate_task("niah_single_1", 200, 1, smollm2_tokenizer)
    with pytest.raises(ValueError, match="unknown RULER task 'niah_single_9'"):
        generate_task("niah_single_9", 4096, 1, smollm2_tokenizer)


def test_largest_fitting_size_finds_the_exact_boundary():
    for budget in (7, 10, 11, 1000, 123_456):
        found = largest_fitting_size(lambda n: 3 * n + 7, budget, smallest=0)
        assert found == (budget - 7) // 3
    # Uneven growth (tokenisation is not linear in the haystack size).
    measure = lambda n: n * 2 + (n // 10) * 5  # noqa: E731
    for budget in (50, 999, 4096):
        found = largest_fitting_size(measure, budget)
        assert measure(found) <= budget < measure(found + 1)
    with pytest.raises(ValueError, match="smallest haystack needs 12 tokens"):
        largest_fitting_size(lambda n: 10 + 2 * n, 11)


def test_zeta_matches_closed_forms():
    assert ruler_data.zeta(2.0) == pytest.approx(math.pi**2 / 6, rel=1e-10)
    assert ruler_data.zeta(4.0) == pytest.approx(math.pi**4 / 90, rel=1e-10)
    with pytest.raises(ValueError, match="alpha must be > 1"):
        ruler_data.zeta(1.0)


def test_synthetic_prose_is_deterministic_and_prefix_stable():
    short, long = synthetic_prose(200), synthetic_prose(2000)
    assert long.startswith(short.rstrip("\n"))
    assert len(long.split()) >= 2000 and synthetic_prose(2000) == long
    sentences = split_sentences(short)
    assert len(sentences) > 10 and all(s[-1] in ".!?" for s in sentences)


def test_essay_folder_is_used_when_present(tmp_path, smollm2_tokenizer):
    essay = " ".join(f"Essay sentence number {i} talks about startups." for i in range(400))
    (tmp_path / "b.txt").write_text(essay)
    (tmp_path / "a.txt").write_text("First file first. ")
    haystack = load_essays(tmp_path)
    assert haystack.source == str(tmp_path) and haystack.text.startswith("First file first.")
    assert load_essays(tmp_path / "missing").source == SYNTHETIC_SOURCE
    (sample,) = generate_task("niah_single_2", 1024, 1, smollm2_tokenizer, essay_dir=tmp_path)
    assert "talks about startups." in sample["input"]


def test_qa_tasks_read_squad_and_hotpotqa_files(tmp_path, smollm2_tokenizer):
    from pathlib import Path

    fixtures = Path(__file__).resolve().parents[2] / "data" / "fixtures" / "ruler"
    for task in ("qa_1", "qa_2"):
        samples = generate_task(task, 1024, 2, smollm2_tokenizer, qa_dir=fixtures)
        for sample in samples:
            assert sample["answer_prefix"] == " Answer:"
            assert any(answer in sample["input"] for answer in sample["outputs"])
            assert re.search(r"Document 1:\n", sample["input"])
            # Within one document (the fixture's are ~60 tokens) of the target.
            assert 1024 - 80 <= sample["length_w_model_temp"] <= 1024
    with pytest.raises(FileNotFoundError, match="squad.json"):
        generate_task("qa_1", 1024, 1, smollm2_tokenizer, qa_dir=tmp_path)


def test_cli_writes_ruler_layout_and_keeps_complete_files(tmp_path, capsys):
    argv = ["--tokenizer", "smollm2-135m", "--lengths", "1024", "--tasks", "niah_single_1,vt",
            "--num_samples", "2", "--out", str(tmp_path)]
    written = ruler_data.main(argv)
    assert written == [tmp_path / "1024" / task / "validation.jsonl" for task in ("niah_single_1", "vt")]
    meta = json.loads((tmp_path / "1024" / "vt" / "generation.json").read_text())
    assert meta["tokenizer"] == "smollm2-135m" and meta["chat_template"] is True and meta["seed"] == 42
    assert meta["wonderwords"] and meta["num_samples"] == 2
    loaded = ruler.load_task(tmp_path, 1024, "vt")
    assert len(loaded) == 2 and loaded[0]["length_w_model_temp"] <= 1024
    before = written[0].stat().st_mtime_ns
    ruler_data.main(argv)
    assert written[0].stat().st_mtime_ns == before and "kept" in capsys.readouterr().out
    ruler_data.main(argv[:-2] + ["--out", str(tmp_path), "--seed", "1"])
    assert written[0].stat().st_mtime_ns != before  # other settings: regenerated


def test_a_niah_file_written_before_needles_were_recorded_is_regenerated(tmp_path):
    argv = ["--tokenizer", "smollm2-135m", "--lengths", "600", "--tasks", "niah_single_1", "--num_samples", "2",
            "--out", str(tmp_path)]
    (path,) = ruler_data.main(argv)
    samples = ruler.read_samples(path)
    meta_path = path.parent / "generation.json"
    meta = json.loads(meta_path.read_text())
    assert meta.pop("needles_recorded") is True
    meta_path.write_text(json.dumps(meta))  # what an older restkv wrote: no needles, no such entry
    path.write_text("".join(json.dumps({k: v for k, v in sample.items() if k != "needles"}) + "\n"
                            for sample in samples))
    ruler_data.main(argv)
    assert ruler.read_samples(path) == samples


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lengths", "100"], "--lengths 100 leaves no room for niah_single_1's 128 generated tokens"),
        (["--lengths", "0"], "--lengths 0 leaves no room"),
        (["--tasks", "niah_single_9"], "unknown RULER task 'niah_single_9'"),
        (["--num_samples", "0"], "--num_samples must be >= 1; got 0"),
        (["--tasks", "qa_1", "--qa_dir", "/nowhere"],
         "qa_1 needs SQuAD 2.0 dev (dev-v2.0.json) at /nowhere/squad.json"),
    ],
)
def test_bad_flags_stop_before_the_tokenizer_loads(flags, message, tmp_path, capsys, monkeypatch):
    import restkv.integrations.transformers.models

    def refuse(*args, **kwargs):
        raise AssertionError("the tokenizer was loaded before the error was found")

    monkeypatch.setattr(restkv.integrations.transformers.models, "load_tokenizer", refuse)
    with pytest.raises(SystemExit) as stop:
        ruler_data.main(["--tokenizer", "smollm2-135m", "--lengths", "1024", "--tasks", "niah_single_1",
                         "--out", str(tmp_path), *flags])
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_a_given_essay_folder_must_hold_essays(tmp_path, capsys, monkeypatch):
    """A typo in --essay_dir fell back to synthetic prose without a word."""
    import restkv.integrations.transformers.models

    def refuse(*args, **kwargs):
        raise AssertionError("the tokenizer was loaded before the error was found")

    monkeypatch.setattr(restkv.integrations.transformers.models, "load_tokenizer", refuse)
    (tmp_path / "empty").mkdir()
    for folder, message in ((tmp_path / "typo", f"--essay_dir {tmp_path / 'typo'}: no such folder"),
                            (tmp_path / "empty", f"--essay_dir {tmp_path / 'empty'} holds no essays")):
        with pytest.raises(SystemExit) as stop:
            ruler_data.main(["--tokenizer", "smollm2-135m", "--lengths", "1024", "--tasks", "niah_single_2",
                             "--essay_dir", str(folder), "--out", str(tmp_path / "out")])
        assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_length_the_task_cannot_fit_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="^error: niah_single_1 cannot fit 200 tokens"):
        ruler_data.main(["--tokenizer", "smollm2-135m", "--lengths", "200", "--tasks", "niah_single_1",
                         "--num_samples", "1", "--out", str(tmp_path)])

