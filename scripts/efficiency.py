"""Prefill time, decode time per token and cache bytes: methods side by side in one run.

    python scripts/efficiency.py --model_path smollm2-135m --lengths 2048 4096 8192 \
        --methods fullkv snapkv --budget_fraction 0.1 --repeats 3

Every repetition runs each method on the same prompt, interleaved, so slow phases of a
shared machine hit all methods alike; the table reports medians and ratios to the first
method. Rows go to ``--out`` (``results/efficiency.json``) for
``visualization/`` plots: {method, prompt_tokens, budget, prefill_s, decode_s_per_token,
cache_bytes}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from restkv.cache import cache_nbytes
from restkv.compat import with_cache
from restkv.generation import prefill
from restkv.models import load_model
from restkv.monkeypatch import configure, replace_for_model


def measure(model, prompt: torch.Tensor, decode_steps: int) -> tuple[float, float, int]:
    """(prefill seconds, decode seconds per token, cache bytes after the prefill)."""
    start = time.perf_counter()
    cache: DynamicCache = prefill(model, prompt)
    prefill_s = time.perf_counter() - start
    nbytes = cache_nbytes(cache)
    token = prompt[:, -1:]
    with torch.no_grad():
        start = time.perf_counter()
        for _ in range(decode_steps):
            token = model(token, logits_to_keep=1, **with_cache(cache)).logits[:, -1:].argmax(dim=-1)
    decode_s = (time.perf_counter() - start) / decode_steps
    return prefill_s, decode_s, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default="smollm2-135m")
    parser.add_argument("--attn_implementation", default="sdpa")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--methods", nargs="+", default=["fullkv", "snapkv"])
    parser.add_argument("--budget_fraction", type=float, default=0.1, help="budget = fraction x prompt tokens")
    parser.add_argument("--decode_steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="results/efficiency.json")
    args = parser.parse_args()

    model = load_model(args.model_path, attn_implementation=args.attn_implementation, dtype=args.dtype)
    replace_for_model(model, method="fullkv")
    generator = torch.Generator().manual_seed(0)
    rows = []
    for length in args.lengths:
        prompt = torch.randint(100, model.config.vocab_size, (1, length), generator=generator).to(model.device)
        budget = max(int(length * args.budget_fraction), 64)
        samples = {method: [] for method in args.methods}
        measure(model, prompt[:, :256], 2)  # warm-up
        for _ in range(args.repeats):
            for method in args.methods:
                options = {} if method == "fullkv" else {"max_capacity_prompts": budget}
                configure(model, method=method, **options)
                samples[method].append(measure(model, prompt, args.decode_steps))
        for method, runs in samples.items():
            prefill_s, decode_s, nbytes = (statistics.median(column) for column in zip(*runs))
            rows.append(
                dict(method=method, prompt_tokens=length, budget=None if method == "fullkv" else budget,
                     prefill_s=prefill_s, decode_s_per_token=decode_s, cache_bytes=int(nbytes))
            )
        print_table([r for r in rows if r["prompt_tokens"] == length])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out}")


def print_table(rows: list[dict]) -> None:
    base = rows[0]
    print(f"\nprompt {base['prompt_tokens']} tokens (ratios vs {base['method']})")
    print(f"{'method':>14} {'budget':>7} {'prefill s':>10} {'ratio':>6} {'decode ms/tok':>14} {'ratio':>6} {'cache MiB':>10} {'ratio':>6}")
    for row in rows:
        print(
            f"{row['method']:>14} {str(row['budget'] or '-'):>7} {row['prefill_s']:>10.3f} "
            f"{row['prefill_s'] / base['prefill_s']:>6.3f} {1000 * row['decode_s_per_token']:>14.2f} "
            f"{row['decode_s_per_token'] / base['decode_s_per_token']:>6.3f} {row['cache_bytes'] / 2**20:>10.2f} "
            f"{row['cache_bytes'] / base['cache_bytes']:>6.4f}"
        )


if __name__ == "__main__":
    main()
