"""Cost of ResKV's residual entries next to their base method, measured side by side.

The ResKV issue's targets, on smollm2-135m with 4K-token prompts on CPU: snapkv+residual
prefill (k-means of every candidate ratio and the validation proxy included) at most
1.25 x snapkv prefill, decode time per token at most 1.20 x snapkv's, cache bytes at most
1.02 x snapkv's. A measurement, not a test: nothing is asserted.

    python scripts/bench_residual.py --length 4096 --budget_fractions 0.1 0.2 --repeats 3 \
        [--variants snapkv snapkv+residual adakv adakv+residual] [--threads 1] [--json out.json]

The prompt is the project's deterministic synthetic prose (real text, so attention and the
validation proxy's choices look like a real run's, unlike random token ids). Every
repetition runs all variants on the same prompt in a rotating order, so load drifts on a
shared machine hit them alike; the table gives medians and ratios to the first variant, plus
how many (layer, KV head) pairs kept residual entries and the mean share of the budget they
took. ``--threads 1`` gives steadier numbers on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from restkv.benchmarks.haystack import synthetic_prose
from restkv.cache import CompressedLayer, cache_nbytes
from restkv.compat import with_cache
from restkv.generation import prefill
from restkv.models import load_model, load_tokenizer
from restkv.monkeypatch import configure, replace_for_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--budget_fractions", type=float, nargs="+", default=[0.1, 0.2],
                        help="budget = fraction x prompt tokens, per layer and KV head")
    parser.add_argument("--variants", nargs="+", default=["snapkv", "snapkv+residual"],
                        help="methods; a +residual suffix turns on --residual with its defaults")
    parser.add_argument("--decode_steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", default=None, help="also write the medians and raw timings to this file")
    return parser.parse_args()


def variant_options(variant: str, budget: int) -> dict:
    method, _, extra = variant.partition("+")
    if extra not in ("", "residual"):
        raise SystemExit(f"unknown variant {variant!r}: use METHOD or METHOD+residual")
    return dict(method=method, max_capacity_prompts=budget, residual=extra == "residual")


def measure(model, prompt: torch.Tensor, decode_steps: int) -> dict:
    """Prefill seconds, decode seconds per token, cache bytes and residual statistics."""
    start = time.perf_counter()
    cache = prefill(model, prompt)
    prefill_s = time.perf_counter() - start
    layers = [layer for layer in cache.layers if isinstance(layer, CompressedLayer)]
    if not layers:
        raise SystemExit("nothing was compressed: lower --budget_fractions or raise --length")
    stats = residual_stats(layers)
    nbytes = cache_nbytes(cache)
    token = prompt[:, -1:]
    with torch.no_grad():
        start = time.perf_counter()
        for _ in range(decode_steps):
            token = model(token, logits_to_keep=1, **with_cache(cache)).logits[:, -1:].argmax(dim=-1)
    decode_s = (time.perf_counter() - start) / decode_steps
    return dict(prefill_s=prefill_s, decode_s_per_token=decode_s, cache_bytes=nbytes, **stats)


def residual_stats(layers: list[CompressedLayer]) -> dict:
    """Share of (layer, KV head) pairs holding residual entries and their mean share of the budget."""
    entries = torch.cat([layer.residual_counts.flatten().float() for layer in layers])
    stored = torch.cat([(layer.kept_counts + layer.residual_counts).flatten().float() for layer in layers])
    with_entries = entries > 0
    share = float((entries[with_entries] / stored[with_entries]).mean()) if bool(with_entries.any()) else 0.0
    return dict(heads_with_residual=float(with_entries.float().mean()), residual_share=share)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, attn_implementation="sdpa")
    tokenizer = load_tokenizer(args.model)
    words = args.length  # prose averages more than one token per word
    ids = tokenizer(synthetic_prose(words), return_tensors="pt").input_ids[:, : args.length]
    if ids.shape[1] < args.length:
        raise SystemExit(f"the synthetic prose gave only {ids.shape[1]} tokens")
    prompt = ids.to(model.device)
    replace_for_model(model, method="snapkv", max_capacity_prompts=64)
    measure(model, prompt[:, :512], 2)  # warm-up
    results = []
    for fraction in args.budget_fractions:
        budget = int(args.length * fraction)
        runs = {variant: [] for variant in args.variants}
        for repeat in range(args.repeats):
            order = args.variants[repeat % len(args.variants):] + args.variants[: repeat % len(args.variants)]
            for variant in order:
                configure(model, **variant_options(variant, budget))
                runs[variant].append(measure(model, prompt, args.decode_steps))
                print(f"budget {budget} repeat {repeat} {variant}: {runs[variant][-1]}", flush=True)
        rows = [dict(variant=v, budget=budget, **{k: statistics.median(r[k] for r in rs) for k in rs[0]}, runs=rs)
                for v, rs in runs.items()]
        print_table(rows, args.length)
        results.extend(rows)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(dict(args=vars(args), rows=results), handle, indent=1)


def print_table(rows: list[dict], length: int) -> None:
    base = rows[0]
    print(f"\n{length}-token prompt, budget {base['budget']} (ratios vs {base['variant']})")
    print(f"{'variant':>18} {'prefill s':>10} {'ratio':>6} {'decode ms/tok':>14} {'ratio':>6} "
          f"{'cache MiB':>10} {'ratio':>7} {'heads w/ res':>12} {'res share':>9}")
    for row in rows:
        print(
            f"{row['variant']:>18} {row['prefill_s']:>10.2f} {row['prefill_s'] / base['prefill_s']:>6.3f} "
            f"{1000 * row['decode_s_per_token']:>14.2f} {row['decode_s_per_token'] / base['decode_s_per_token']:>6.3f} "
            f"{row['cache_bytes'] / 2**20:>10.3f} {row['cache_bytes'] / base['cache_bytes']:>7.4f} "
            f"{row['heads_with_residual']:>12.2%} {row['residual_share']:>9.2%}"
        )


if __name__ == "__main__":
    main()
