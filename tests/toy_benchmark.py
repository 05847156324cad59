"""A toy benchmark over a tiny random Llama with SmolLM2's vocabulary: real prompts, fast
deterministic answers (shared by the runner, prompt and scoring tests)."""

from __future__ import annotations

import json

from restkv.benchmarks import runner
from restkv.benchmarks.benchmark import Benchmark, Question, Sample

STORY = " ".join(f"On day {i} the keeper of the lighthouse wrote that the sea was calm." for i in range(12))


def toy_samples(args, dataset, tokenizer):
    """Five prompts of ~170 tokens whose answer is a number in the context."""
    return [
        Sample(
            id=f"q{i}",
            context=f"Read the log.\n\n{STORY} The door code is {4000 + 17 * i}.\n\n",
            question="Question: what is the door code?\nAnswer:",
            max_new_tokens=3,
            fields={"answers": [str(4000 + 17 * i)]},
        )
        for i in range(5)
    ]


def toy_score(dataset, records):
    """Percent of predictions that contain their door code."""
    return round(100 * sum(r["answers"][0] in r["pred"] for r in records) / len(records), 2)


TOY = Benchmark("toy", datasets=("logs", "other"), default_datasets=("logs",), load_samples=toy_samples,
                score=toy_score, default_data_dir="data/toy")


DOORS = ("north", "south", "east")


def door_code(log: int, door: int) -> str:
    return str(5000 + 101 * log + 7 * door)


def toy_multi_samples(args, dataset, tokenizer):
    """Three logs of ~200 tokens, each with the codes of three doors and a question per door
    (the first with an answer prefix of its own)."""
    return [
        Sample(
            id=f"log{i}",
            context=f"Read the log.\n\n{STORY}"
                    + "".join(f" The {door} door code is {door_code(i, k)}." for k, door in enumerate(DOORS)) + "\n\n",
            question="",
            max_new_tokens=3,
            fields={"log": i},
            questions=tuple(
                Question(f"Question: what is the {door} door code?\nAnswer:", " The code is" if k == 0 else "",
                         {"answers": [door_code(i, k)]})
                for k, door in enumerate(DOORS)
            ),
        )
        for i in range(3)
    ]


TOY_MULTI = Benchmark("toy", datasets=("logs",), default_datasets=("logs",), load_samples=toy_multi_samples,
                      score=toy_score, default_data_dir="data/toy")

TOY_FLAGS = ["--method", "snapkv", "--max_capacity_prompts", "48", "--window_size", "8"]


def toy_run(tmp_path, tiny, tokenizer, *flags, benchmark=TOY):
    return runner.main(benchmark, ["--save_dir", str(tmp_path), *TOY_FLAGS, *flags], model=tiny, tokenizer=tokenizer)


def lines_of(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
