"""AdaKV prefill time against SnapKV, measured side by side in one run.

The allocation issue's closing note: on smollm2-135m, 4K-token prompts, CPU, adakv prefill at
most 1.15 x snapkv prefill. AdaKV adds a per-layer global ranking of the heads' scores and
ragged storage to SnapKV's scoring. Repetitions interleave the variants in a rotating order
(load drifts on a shared machine hit all of them alike); medians are reported, and the
median of the per-repeat adakv / snapkv ratios (each from back-to-back prefills). A second
measurement times ``compress_kv`` alone over every layer on layer-shaped random tensors.

    python scripts/bench_allocation.py --length 4096 --repeats 5 --threads 1 [--json out.json]

A measurement, not a test: nothing is asserted. ``--variants`` adds e.g. pyramidkv.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from restkv.cache import cache_report
from restkv.compress import compress_kv
from restkv.generation import prefill
from restkv.models import load_model
from restkv.monkeypatch import replace_for_model, unpatch

BASELINE = "snapkv"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--max_capacity_prompts", type=int, default=128, help="tokens per layer and KV head")
    parser.add_argument("--variants", nargs="+", default=["fullkv", "snapkv", "adakv"],
                        help="methods to time (fullkv = unpatched full cache)")
    parser.add_argument("--repeats", type=int, default=5, help="timed prefills per variant")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt and tensors")
    parser.add_argument("--json", default=None, help="also write the raw timings to this file")
    args = parser.parse_args()
    for needed in (BASELINE, "adakv"):
        if needed not in args.variants:
            parser.error(f"--variants must include {needed} (the ratio compares adakv with {BASELINE})")
    return args


def options_of(method: str, budget: int) -> dict | None:
    """Library defaults of the method; None runs the unpatched model."""
    return None if method == "fullkv" else dict(method=method, max_capacity_prompts=budget)


def run_prefill(model, input_ids: torch.Tensor, method: str, budget: int) -> float:
    """Seconds of one prefill; checks the cache came out as the variant intends."""
    options = options_of(method, budget)
    if options is None:
        unpatch()
    else:
        replace_for_model(model, **options)
    start = time.perf_counter()
    cache = prefill(model, input_ids)
    elapsed = time.perf_counter() - start
    reports = cache_report(cache)
    if options is not None and not all(report.compressed for report in reports):
        raise RuntimeError(f"{method}: some layers were not compressed")
    if method == "adakv" and all(report.stored_min == report.stored_max for report in reports):
        raise RuntimeError("adakv: every head kept the same count; the head-adaptive allocation did not run")
    return elapsed


def time_compress_kv(model, methods: list[str], length: int, budget: int, repeats: int, seed: int):
    """Seconds of ``compress_kv`` over all layers on random layer-shaped tensors, per method."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, heads, length, head_dim, generator=generator)
    key = torch.randn(1, kv_heads, length, head_dim, generator=generator)
    value = torch.randn(1, kv_heads, length, head_dim, generator=generator)
    num_layers = config.num_hidden_layers
    times: dict[str, list[float]] = {method: [] for method in methods}
    for repeat in range(repeats + 1):  # round 0 warms up
        for method in in_rotation(methods, repeat):
            start = time.perf_counter()
            for layer_idx in range(num_layers):
                compress_kv(query, key, value, options_of(method, budget), layer_idx, num_layers)
            if repeat:
                times[method].append(time.perf_counter() - start)
    return times


def in_rotation(names: list[str], shift: int) -> list[str]:
    shift %= len(names)
    return names[shift:] + names[:shift]


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, attn_implementation="sdpa")
    generator = torch.Generator().manual_seed(args.seed)
    input_ids = torch.randint(100, model.config.vocab_size, (1, args.length), generator=generator)

    prefill_times: dict[str, list[float]] = {method: [] for method in args.variants}
    with torch.no_grad():
        for method in args.variants:  # warm-up
            run_prefill(model, input_ids, method, args.max_capacity_prompts)
        for repeat in range(args.repeats):
            for method in in_rotation(args.variants, repeat):
                prefill_times[method].append(run_prefill(model, input_ids, method, args.max_capacity_prompts))
                print(f"  repeat {repeat}: {method:9s} {prefill_times[method][-1]:.3f} s", flush=True)
        unpatch()
        compressing = [m for m in args.variants if m != "fullkv"]
        compress_times = time_compress_kv(model, compressing, args.length, args.max_capacity_prompts, args.repeats,
                                          args.seed)

    prefill_median = {m: statistics.median(t) for m, t in prefill_times.items()}
    compress_median = {m: statistics.median(t) for m, t in compress_times.items()}
    print(f"\n{args.model}, {args.length} tokens, budget {args.max_capacity_prompts}, "
          f"{torch.get_num_threads()} threads, {args.repeats} interleaved repeats (medians)")
    for method in args.variants:
        extra = f"   compress_kv over all layers {compress_median[method]:.3f} s" if method in compress_median else ""
        print(f"  prefill {method:9s} {prefill_median[method]:.3f} s{extra}")
    ratio = prefill_median["adakv"] / prefill_median[BASELINE]
    # Each repeat times both variants back to back, so its own ratio cancels slow load drifts.
    paired = sorted(a / b for a, b in zip(prefill_times["adakv"], prefill_times[BASELINE]))
    print(f"  adakv / snapkv prefill: {ratio:.3f} of medians, {statistics.median(paired):.3f} median of "
          f"per-repeat ratios (range {paired[0]:.3f}-{paired[-1]:.3f})  (target <= 1.15)")
    print(f"  adakv / snapkv compress_kv: {compress_median['adakv'] / compress_median[BASELINE]:.3f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(dict(args=vars(args), prefill=prefill_times, compress_kv=compress_times,
                           adakv_over_snapkv_prefill=ratio, paired_ratios=paired), handle, indent=2)


if __name__ == "__main__":
    main()
