"""A toy benchmark over a tiny random Llama with SmolLM2's vocabulary: real prompts, fast
deterministic answers (shared by the runner, prompt and scoring tests)."""

from __future__ import annotations

import json

from restkv.benchmarks import runner
from restkv.benchmarks.benchmark import Benchmark, Sample

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


def toy_run(tmp_path, tiny, tokenizer, *flags):
    base = ["--save_dir", str(tmp_path), "--method", "snapkv", "--max_capacity_prompts", "48", "--window_size", "8"]
    return runner.main(TOY, [*base, *flags], model=tiny, tokenizer=tokenizer)


def lines_of(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
