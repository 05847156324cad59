"""Prefill time of ReST-KV against SnapKV (and the full cache), measured side by side.

The ReST-KV issue's target: on smollm2-135m, 4K-token prompts, CPU, restkv prefill with its
default flags (``--use_wo --use_ema --pooling adaptive``) at most 1.10 x snapkv prefill.
Repetitions interleave the variants (in a rotating order) so that load drifts on a shared
machine hit all of them alike; medians are reported. A second, quieter measurement times
``compress_kv`` alone on layer-shaped tensors (the scorer's own cost per prefill).

    python scripts/bench_restkv.py --length 4096 --repeats 5 [--threads 1] [--json out.json]

On a machine shared with other jobs, ``--threads 1`` gives far steadier numbers (torch's
thread pool waits on descheduled threads at every operation). It is a measurement, not a
test: nothing is asserted.
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

VARIANTS = ("fullkv", "snapkv", "restkv")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--max_capacity_prompts", type=int, default=128, help="tokens kept per layer and KV head")
    parser.add_argument("--repeats", type=int, default=5, help="timed prefills per variant")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt and tensors")
    parser.add_argument("--json", default=None, help="also write the raw timings to this file")
    return parser.parse_args()


def method_options(name: str, budget: int) -> dict | None:
    """Library defaults of each method (restkv: the paper's flags); None = unpatched full cache."""
    return None if name == "fullkv" else dict(method=name, max_capacity_prompts=budget)


def timed_prefill(model, input_ids: torch.Tensor, options: dict | None) -> float:
    if options is None:
        unpatch()
    else:
        replace_for_model(model, **options)
    start = time.perf_counter()
    cache = prefill(model, input_ids)
    elapsed = time.perf_counter() - start
    compressed = any(report.compressed for report in cache_report(cache)) if options is not None else False
    if (options is not None) != compressed:
        raise RuntimeError(f"variant {options} did not run as intended (compressed={compressed})")
    return elapsed


def timed_scoring(model, length: int, budget: int, repeats: int, seed: int) -> dict[str, list[float]]:
    """Seconds of ``compress_kv`` over every layer for random layer-shaped tensors, per method."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, heads, length, head_dim, generator=generator)
    key = torch.randn(1, kv_heads, length, head_dim, generator=generator)
    value = torch.randn(1, kv_heads, length, head_dim, generator=generator)
    weights = [layer.self_attn.o_proj.weight.detach() for layer in model.model.layers]
    times: dict[str, list[float]] = {"snapkv": [], "restkv": []}
    for repeat in range(repeats + 1):  # the first round warms up
        for name in rotated(list(times), repeat):
            options = method_options(name, budget)
            start = time.perf_counter()
            for layer_idx, weight in enumerate(weights):
                compress_kv(query, key, value, options, layer_idx, len(weights), weight)
            if repeat:
                times[name].append(time.perf_counter() - start)
    return times


def rotated(names: list[str], shift: int) -> list[str]:
    shift %= len(names)
    return names[shift:] + names[:shift]


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, attn_implementation="sdpa")
    generator = torch.Generator().manual_seed(args.seed)
    input_ids = torch.randint(100, model.config.vocab_size, (1, args.length), generator=generator)

    prefill_times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with torch.no_grad():
        for name in VARIANTS:  # warm-up
            timed_prefill(model, input_ids, method_options(name, args.max_capacity_prompts))
        for repeat in range(args.repeats):
            for name in rotated(list(VARIANTS), repeat):
                options = method_options(name, args.max_capacity_prompts)
                prefill_times[name].append(timed_prefill(model, input_ids, options))
                print(f"  repeat {repeat}: {name:7s} {prefill_times[name][-1]:.3f} s", flush=True)
        unpatch()
        scoring_times = timed_scoring(model, args.length, args.max_capacity_prompts, args.repeats, args.seed)

    prefill_median = {name: statistics.median(times) for name, times in prefill_times.items()}
    scoring_median = {name: statistics.median(times) for name, times in scoring_times.items()}
    print(f"\n{args.model}, {args.length} tokens, budget {args.max_capacity_prompts}, "
          f"{torch.get_num_threads()} threads, {args.repeats} interleaved repeats (medians)")
    for name in VARIANTS:
        print(f"  prefill {name:7s} {prefill_median[name]:.3f} s")
    print(f"  restkv / snapkv prefill: {prefill_median['restkv'] / prefill_median['snapkv']:.3f}  (target <= 1.10)")
    print(f"  snapkv / fullkv prefill: {prefill_median['snapkv'] / prefill_median['fullkv']:.3f}")
    print(f"  compress_kv over all layers: snapkv {scoring_median['snapkv']:.3f} s, "
          f"restkv {scoring_median['restkv']:.3f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(dict(args=vars(args), prefill=prefill_times, scoring=scoring_times), handle, indent=2)


if __name__ == "__main__":
    main()
