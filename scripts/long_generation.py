"""Long generation under a decode budget: stored tokens, time per token and text, beside the full cache.

    python scripts/long_generation.py --prompt_tokens 1024 --new_tokens 2048 --decode_budget 512

Generates ``--new_tokens`` greedy tokens after a ``--prompt_tokens`` prose prompt twice on the
same model: with the full cache, and with ``--method`` compressing the prompt to
``--max_capacity_prompts`` and then, every ``--decode_interval`` tokens, back to
``--decode_budget`` entries per layer and KV head. Every step's wall time and the entries
layer 0 stores are recorded; the table prints them at a few points of the generation
(tokens seen, stored, ms per token over the last stretch, for both runs) and the length of
the common prefix of the two texts. Rows go to ``--out`` (JSON) for plots. A measurement,
not a test: nothing is asserted. ``--threads 1`` steadies the timings on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from restkv.benchmarks.config_file import add_config_flags, parse_command_line
from restkv.benchmarks.errors import command_line
from restkv.benchmarks.flags import check_minimums, check_output_path
from restkv.benchmarks.haystack import synthetic_prose
from restkv.config import CompressionConfig
from restkv.integrations.transformers.models import (check_model_path, check_supported, load_model, load_tokenizer,
                                                     model_path_errors)
from restkv.integrations.transformers.patching import compression, replace_for_model


class StepClock(LogitsProcessor):
    """Records the time of every decoding step and what layer 0's cache stores (a logits
    processor runs once per generated token, after the forward)."""

    def __init__(self, cache_of) -> None:
        self.cache_of = cache_of
        self.times: list[float] = []
        self.stored: list[int] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        layer = self.cache_of().layers[0]
        if hasattr(layer, "held_counts"):
            self.stored.append(int((layer.held_counts + layer.summary_slots).max()))
        else:
            self.stored.append(layer.get_seq_length())
        return scores


def run(model, prompt: torch.Tensor, new_tokens: int) -> tuple[list[int], list[float], list[int]]:
    """Greedy ids, per-step seconds and stored entries of one generation."""
    from transformers import DynamicCache

    from restkv.integrations.transformers.compat import with_cache

    cache = DynamicCache(config=model.config)
    clock = StepClock(lambda: cache)
    start = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         logits_processor=LogitsProcessorList([clock]), return_dict_in_generate=True,
                         **with_cache(cache))
    marks = [start, *clock.times]
    seconds = [b - a for a, b in zip(marks[:-1], marks[1:])]  # the first one includes the prefill
    return out.sequences[0, prompt.shape[1]:].tolist(), seconds, clock.stored


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, CompressionConfig]:
    """The flags and the compressed run's config, checked before any model work (a budget below the
    window or a method that cannot compress while generating once failed after the whole
    full-cache run)."""
    args, _ = parse_command_line(build_parser, argv)
    check_minimums(args, {"prompt_tokens": 1, "new_tokens": 1, "threads": 1})
    config = CompressionConfig(method=args.method, max_capacity_prompts=args.max_capacity_prompts,
                               window_size=args.window_size, decode_budget=args.decode_budget,
                               decode_interval=args.decode_interval)
    check_model_path(args.model_path)
    check_output_path(args.out, "--out")
    return args, config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default="smollm2-135m")
    parser.add_argument("--method", default="snapkv")
    parser.add_argument("--prompt_tokens", type=int, default=1024)
    parser.add_argument("--new_tokens", type=int, default=2048)
    parser.add_argument("--max_capacity_prompts", type=int, default=512)
    parser.add_argument("--decode_budget", type=int, default=512)
    parser.add_argument("--decode_interval", type=int, default=32)
    parser.add_argument("--window_size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="results/long_generation.json")
    add_config_flags(parser)
    return parser


@command_line
def main(argv: list[str] | None = None, model=None, tokenizer=None) -> dict:
    """The command line; ``model``/``tokenizer`` skip loading (tests). Returns what ``--out`` holds."""
    args, config = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with model_path_errors(args.model_path):
        tokenizer = tokenizer or load_tokenizer(args.model_path)
        model = model or load_model(args.model_path)
    check_supported(model, args.model_path)
    prompt = tokenizer(synthetic_prose(args.prompt_tokens), return_tensors="pt").input_ids[:, : args.prompt_tokens]
    replace_for_model(model, config)  # checked against the model before the full-cache run
    with torch.no_grad():
        with compression(model, method="fullkv"):
            full_ids, full_seconds, full_stored = run(model, prompt, args.new_tokens)
        ids, seconds, stored = run(model, prompt, args.new_tokens)
    agree = next((i for i, (a, b) in enumerate(zip(full_ids, ids)) if a != b), len(ids))
    points = sorted({1, *range(0, args.new_tokens + 1, max(args.new_tokens // 8, 1))} - {0})
    rows = []
    print(f"{args.model_path}, {prompt.shape[1]}-token prompt, {args.new_tokens} new tokens, {args.method} "
          f"decode_budget {args.decode_budget} every {args.decode_interval}")
    print(f"{'tokens seen':>11} {'full stored':>11} {'stored':>7} {'full ms/token':>13} {'ms/token':>9}")
    previous = 0
    for point in points:
        stretch = slice(max(previous, 1), point)  # decode steps only (step 0 holds the prefill)
        full_ms = 1000 * sum(full_seconds[stretch]) / max(point - max(previous, 1), 1)
        ms = 1000 * sum(seconds[stretch]) / max(point - max(previous, 1), 1)
        rows.append(dict(tokens_seen=prompt.shape[1] + point, full_stored=full_stored[point - 1],
                         stored=stored[point - 1], full_ms_per_token=full_ms, ms_per_token=ms))
        print(f"{prompt.shape[1] + point:>11} {full_stored[point - 1]:>11} {stored[point - 1]:>7} {full_ms:>13.1f} "
              f"{ms:>9.1f}")
        previous = point
    print(f"the texts agree on the first {agree} of {len(ids)} generated tokens; largest stored entries "
          f"{max(stored)} (budget {args.decode_budget} + interval {args.decode_interval})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = dict(settings=vars(args), config=config.to_dict(), agree=agree, rows=rows, stored=stored,
                   full_stored=full_stored, seconds=seconds, full_seconds=full_seconds)
    out.write_text(json.dumps(results, indent=1))
    print(f"(written to {out})")
    return results


if __name__ == "__main__":
    main()
