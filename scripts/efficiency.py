"""Prefill time, decode time per token and cache bytes: methods side by side in one run.

    python scripts/efficiency.py --lengths 2048 4096 8192 --methods fullkv snapkv
    python scripts/efficiency.py --lengths 4096 --methods snapkv restkv adakv snapkv+residual \
        --budget_fractions 0.1 0.2 --repeats 5 --threads 1 --scoring

A method may carry boolean switches after ``+`` (``snapkv+residual``, ``restkv+use_pyramid``).
Every repetition runs all methods on the same prompt in a rotating order, so slow phases of a
shared machine hit them alike; the table gives medians, ratios to ``--baseline`` (snapkv when
it runs) and the median of the per-repetition prefill ratios (each repetition times the
methods back to back, so its own ratio cancels slow drifts). ``--scoring`` also times
``compress_kv`` alone on layer-shaped random tensors: the scorer's own cost, without the
model's forward around it. ``--threads 1`` gives far steadier numbers on a busy machine
(torch's thread pool waits on descheduled threads at every operation); ``--clock cpu`` then
times the CPU seconds the process spends instead of the host clock, so time the process
waits while other programs run is not counted (on a machine shared with other jobs the host
clock of one prefill can vary threefold; with one thread the CPU time is the work itself).

The prompt is the project's deterministic synthetic prose (``--prompt random``: random token
ids), so attention, and what data-dependent methods decide, look like a real run's. Every
compressing run is checked to have compressed. Rows go to ``--out`` for ``visualization/``:
{method, prompt_tokens, budget, prefill_s, decode_s_per_token, cache_bytes, kept_share,
residual_share}. A measurement, not a test: nothing is asserted.

``--peak_memory`` measures what a prefill and its decode hold at their peak instead, each
method and length in a fresh process (the high-water mark of its resident memory, ``VmHWM``,
less what the process held once the model and prompt were ready; ``scripts/gpu_bench.py``
reports ``torch.cuda.max_memory_allocated`` on a GPU). With ``--model_shape tiny-wide`` (a random
Llama shape, ``scripts/model_shapes.py``) and a fixed ``--budget`` it shows what chunked
prefill bounds:

    python scripts/efficiency.py --peak_memory --model_shape tiny-wide --lengths 4096 8192 16384 \
        --budget 512 --methods fullkv snapkv snapkv+prefill_chunk_size=1024
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

import torch
from model_shapes import CONFIGS, build_model, shape_flag_of_old  # noqa: E402

from restkv.benchmarks.config_file import add_config_flags, parse_command_line
from restkv.benchmarks.errors import FlagError, command_line
from restkv.benchmarks.flags import ATTN_IMPLEMENTATIONS, check_attn_implementation, check_minimums, check_output_path
from restkv.benchmarks.haystack import synthetic_prose
from restkv.cache import cache_report
from restkv.config import config_from_spec
from restkv.integrations.transformers.compat import with_cache
from restkv.integrations.transformers.generation import prefill
from restkv.integrations.transformers.models import (DTYPES, check_model_path, check_supported, load_model,
                                                     load_tokenizer, model_path_errors)
from restkv.integrations.transformers.patching import replace_for_model
from restkv.integrations.transformers.reconstruction_prompt import set_reconstruction_prompt
from restkv.pipeline.compress import compress_kv

sys.path.insert(0, str(Path(__file__).resolve().parent))

T = TypeVar("T")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default="smollm2-135m")
    parser.add_argument("--attn_implementation", default="sdpa", choices=ATTN_IMPLEMENTATIONS)
    parser.add_argument("--dtype", default=None, choices=list(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192], help="prompt tokens")
    parser.add_argument("--methods", nargs="+", default=["fullkv", "snapkv"], help="METHOD or METHOD+SWITCH...")
    parser.add_argument("--baseline", default=None, help="method the ratios refer to (default: snapkv if run)")
    parser.add_argument("--budget_fractions", type=float, nargs="+", default=[0.1],
                        help="budget = fraction x prompt tokens, per layer and KV head")
    parser.add_argument("--decode_steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", choices=["prose", "random"], default="prose")
    parser.add_argument("--scoring", action="store_true", help="also time compress_kv alone per method")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: host clock; cpu: CPU seconds of the process (steady on a shared machine; "
                             "use it with --threads 1)")
    parser.add_argument("--out", default="results/efficiency.json")
    parser.add_argument("--model_shape", choices=sorted(CONFIGS), default=None,
                        help="a model shape with random weights instead of --model_path (scripts/model_shapes.py); "
                             "--config NAME, its earlier spelling, still chooses one")
    parser.add_argument("--budget", type=int, default=None,
                        help="tokens per layer and KV head for every length (instead of --budget_fractions)")
    parser.add_argument("--peak_memory", action="store_true",
                        help="peak memory of each prefill + decode, each run in a fresh process (no timing)")
    parser.add_argument("--peak_run", default=None, help=argparse.SUPPRESS)  # one run of --peak_memory
    add_config_flags(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every number and every method at every budget checked before any model work
    (``FlagError``/``ConfigError``: one ``error:`` line from ``main``)."""
    args, _ = parse_command_line(build_parser, shape_flag_of_old(argv))
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what each --peak_memory run is given
    check_minimums(args, {"lengths": 1, "budget": 1, "decode_steps": 1, "repeats": 1, "threads": 1})
    if not all(0 < fraction < 1 for fraction in args.budget_fractions):
        raise FlagError(f"--budget_fractions must lie in (0, 1); got {' '.join(map(str, args.budget_fractions))}")
    check_methods(args.methods, {length: budgets_for(args, length) for length in args.lengths})
    if args.model_shape is None:
        check_model_path(args.model_path)
    check_attn_implementation(args.attn_implementation)
    check_output_path(args.out, "--out")
    args.baseline = args.baseline or ("snapkv" if "snapkv" in args.methods else args.methods[0])
    if args.baseline not in args.methods:
        raise FlagError(f"--baseline {args.baseline} is not among --methods")
    return args


def check_methods(specs: list[str], budgets: dict[int, list[int]]) -> None:
    """Every method spec must build at every budget of every prompt length (``budgets``: length ->
    budgets), and a compressing one must have something to compress (a budget below the length)."""
    for length, length_budgets in budgets.items():
        for budget in length_budgets:
            if budget < 1:
                raise FlagError(f"--budget_fractions give a {length}-token prompt a budget of {budget} tokens")
            for spec in specs:
                if config_from_spec(spec, max_capacity_prompts=budget).policy.evicts and budget >= length:
                    raise FlagError(f"--methods {spec}: a budget of {budget} tokens compresses nothing in a "
                                    f"{length}-token prompt; raise --lengths or lower the budget")


def make_prompt(tokenizer, vocab_size: int, length: int, kind: str) -> torch.Tensor:
    if kind == "random":
        generator = torch.Generator().manual_seed(length)
        return torch.randint(100, vocab_size, (1, length), generator=generator)
    ids = tokenizer(synthetic_prose(length), return_tensors="pt").input_ids[:, :length]
    if ids.shape[1] < length:
        raise SystemExit(f"the synthetic prose gave only {ids.shape[1]} of {length} tokens")
    return ids


def wall_seconds(run: Callable[[], T]) -> tuple[T, float]:
    """``run()`` and the seconds it took by the host clock (CPU runs)."""
    start = time.perf_counter()
    result = run()
    return result, time.perf_counter() - start


def cpu_seconds(run: Callable[[], T]) -> tuple[T, float]:
    """``run()`` and the CPU seconds the process spent on it (every thread; none while descheduled)."""
    start = time.process_time()
    result = run()
    return result, time.process_time() - start


#: ``--clock``: how a region is timed
CLOCKS = {"wall": wall_seconds, "cpu": cpu_seconds}


def measure(model, prompt: torch.Tensor, decode_steps: int, compressing: bool,
            timed: Callable[[Callable[[], T]], tuple[T, float]] = wall_seconds) -> dict:
    """Prefill seconds, decode seconds per token, and what the cache holds after the prefill
    (``timed`` runs a region and returns its result and seconds: ``wall_seconds``, or a device
    clock that waits for the device's work, ``scripts/gpu_bench.py``)."""
    cache, prefill_s = timed(lambda: prefill(model, prompt))
    reports = cache_report(cache)
    if compressing and not any(report.compressed for report in reports):
        raise SystemExit("a compressing method kept every token: raise --lengths or lower the budget")
    seen = sum(report.tokens_seen for report in reports)
    exact = sum(report.stored_mean for report in reports)
    residual = sum(report.summary_slots for report in reports)
    _, decode_s = timed(lambda: decode(model, cache, prompt[:, -1:], decode_steps))
    return dict(prefill_s=prefill_s, decode_s_per_token=decode_s / decode_steps,
                cache_bytes=sum(r.nbytes for r in reports), kept_share=(exact + residual) / seen,
                residual_share=residual / max(exact + residual, 1e-9))


@torch.no_grad()
def decode(model, cache, token: torch.Tensor, steps: int) -> torch.Tensor:
    """``steps`` greedy decode steps from ``token`` ``[B, 1]`` over ``cache``; the last token."""
    for _ in range(steps):
        token = model(token, logits_to_keep=1, **with_cache(cache)).logits[:, -1:].argmax(dim=-1)
    return token


def set_method(model, spec: str, budget: int) -> bool:
    """Give ``model`` a fresh config for method ``spec`` at ``budget`` (switches of the previous
    variant must not linger); whether it compresses."""
    config = config_from_spec(spec, max_capacity_prompts=budget)
    replace_for_model(model, config)
    return config.policy.evicts


def interleaved_runs(model, prompt: torch.Tensor, specs: list[str], budget: int, repeats: int, decode_steps: int,
                     run: Callable[..., dict] = measure) -> dict[str, list[dict]]:
    """Each method's ``run(model, prompt, decode_steps, compressing)`` rows: every repetition runs
    every method once on the same prompt, in an order rotated by one each time."""
    runs: dict[str, list[dict]] = {spec: [] for spec in specs}
    for repeat in range(repeats):
        for spec in rotated(specs, repeat):
            runs[spec].append(run(model, prompt, decode_steps, set_method(model, spec, budget)))
            print(f"  {prompt.shape[1]} tokens, budget {budget}, repeat {repeat}: {spec:18s} "
                  f"prefill {runs[spec][-1]['prefill_s']:.3f} s", flush=True)
    return runs


def time_scoring(model, specs: list[str], length: int, budget: int, repeats: int,
                 timed: Callable[[Callable[[], T]], tuple[T, float]] = wall_seconds) -> dict[str, float]:
    """Median seconds of ``compress_kv`` over every layer, per method, on random layer-shaped tensors."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, heads, length, head_dim, generator=generator)
    key, value = (torch.randn(1, kv_heads, length, head_dim, generator=generator) for _ in range(2))
    weights = [layer.self_attn.o_proj.weight.detach() for layer in model.model.layers]
    times: dict[str, list[float]] = {spec: [] for spec in specs}
    for repeat in range(repeats + 1):  # round 0 warms up
        for spec in rotated(specs, repeat):
            config = config_from_spec(spec, max_capacity_prompts=budget)
            _, seconds = timed(lambda: [compress_kv(query, key, value, config, layer_idx, len(weights), weight)
                                        for layer_idx, weight in enumerate(weights)])
            if repeat:
                times[spec].append(seconds)
    return {spec: statistics.median(values) for spec, values in times.items()}


def rotated(names: list[str], shift: int) -> list[str]:
    shift %= len(names)
    return names[shift:] + names[:shift]


def load(args: argparse.Namespace, max_positions: int):
    """The model and tokenizer to measure: ``--model_shape``'s shape with random weights (random
    prompts; no tokenizer, so a method that repeats the context does so without its instruction),
    or ``--model_path`` (with its reconstruction prompt, the instruction a real run reads)."""
    if args.model_shape is not None:
        args.prompt = "random"
        return build_model(args.model_shape, torch.float32, torch.device("cpu"), args.attn_implementation,
                           max_positions), None
    with model_path_errors(args.model_path):
        model = load_model(args.model_path, attn_implementation=args.attn_implementation, dtype=args.dtype)
        tokenizer = load_tokenizer(args.model_path)
    check_supported(model, args.model_path)
    set_reconstruction_prompt(model, tokenizer)
    return model, tokenizer


def budgets_for(args: argparse.Namespace, length: int) -> list[int]:
    return [args.budget] if args.budget is not None else [int(length * f) for f in args.budget_fractions]


def resident_bytes(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (the high-water mark) of this process, from /proc."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise SystemExit(f"--peak_memory reads {field} from /proc/self/status, which this system does not have")


def peak_run(args: argparse.Namespace) -> dict:
    """One ``--peak_memory`` run (in its own process): prefill + decode of one method at one
    length; prints (and returns) a JSON row."""
    job = json.loads(args.peak_run)
    length, budget, spec = job["length"], job["budget"], job["method"]
    model, tokenizer = load(args, length + args.decode_steps + 1)
    prompt = make_prompt(tokenizer, model.config.vocab_size, length, args.prompt)
    compressing = set_method(model, spec, budget)
    with torch.no_grad():
        ready = resident_bytes("VmRSS")
        row = measure(model, prompt, args.decode_steps, compressing)
        peak = resident_bytes("VmHWM")
    row.update(method=spec, prompt_tokens=length, budget=None if spec == "fullkv" else budget,
               peak_memory_bytes=peak, peak_above_ready_bytes=peak - ready)
    print(json.dumps(row))
    return row


def peak_memory_rows(args: argparse.Namespace) -> list[dict]:
    """Every method at every length, each in a fresh process (a process's high-water mark
    never comes down, so runs cannot share one)."""
    rows = []
    base = [arg for arg in args.argv if not arg.startswith("--peak_memory")]
    for length in args.lengths:
        for budget in budgets_for(args, length):
            for spec in args.methods:
                job = json.dumps(dict(length=length, budget=budget, method=spec))
                done = subprocess.run([sys.executable, __file__, *base, "--peak_run", job], capture_output=True,
                                      text=True)
                if done.returncode != 0:
                    raise SystemExit(f"{spec} at {length} tokens failed:\n{done.stderr.strip()}")
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"  {length} tokens, budget {budget}: {spec:32s} peak {rows[-1]['peak_memory_bytes'] / 2**20:.0f} "
                      f"MiB, {rows[-1]['peak_above_ready_bytes'] / 2**20:.0f} MiB above the loaded model", flush=True)
    return rows


def format_peak_table(rows: list[dict], baseline: str) -> str:
    """Peak memory per method and length: absolute, above the loaded model, and the latter's
    ratio to ``baseline``'s at the same length."""
    lines = [f"peak memory of prefill + decode (MiB; ratios of the memory above the loaded model vs {baseline})",
             f"{'method':>34} {'tokens':>7} {'budget':>6} {'peak':>8} {'above model':>11} {'ratio':>6} "
             f"{'cache MiB':>9}"]
    for row in rows:
        base = next(r for r in rows if r["method"] == baseline and r["prompt_tokens"] == row["prompt_tokens"])
        lines.append(
            f"{row['method']:>34} {row['prompt_tokens']:>7} {row['budget'] or '-':>6} "
            f"{row['peak_memory_bytes'] / 2**20:>8.0f} {row['peak_above_ready_bytes'] / 2**20:>11.0f} "
            f"{row['peak_above_ready_bytes'] / base['peak_above_ready_bytes']:>6.3f} {row['cache_bytes'] / 2**20:>9.2f}"
        )
    return "\n".join(lines)


def write_rows(path: str, rows: list[dict]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(rows, indent=1))
    print(f"wrote {path}")


@command_line
def main(argv: list[str] | None = None) -> list[dict]:
    """The command line; returns the rows written to ``--out``."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.peak_run is not None:
        return [peak_run(args)]
    if args.peak_memory:
        rows = peak_memory_rows(args)
        print("\n" + format_peak_table(rows, "fullkv" if "fullkv" in args.methods else args.baseline))
        write_rows(args.out, rows)
        return rows
    model, tokenizer = load(args, max(args.lengths) + args.decode_steps + 1)
    replace_for_model(model, method="snapkv", max_capacity_prompts=64)
    timed = CLOCKS[args.clock]
    run = functools.partial(measure, timed=timed)
    rows = []
    with torch.no_grad():
        for length in args.lengths:
            prompt = make_prompt(tokenizer, model.config.vocab_size, length, args.prompt).to(model.device)
            measure(model, prompt[:, :512], 2, compressing=False)  # warm-up (a short prompt may keep everything)
            for budget in budgets_for(args, length):
                runs = interleaved_runs(model, prompt, args.methods, budget, args.repeats, args.decode_steps, run)
                scoring = time_scoring(model, [s for s in args.methods if s != "fullkv"], length, budget,
                                       args.repeats, timed) if args.scoring else {}
                block = [summarise(spec, length, budget, spec_runs, runs[args.baseline], scoring.get(spec))
                         for spec, spec_runs in runs.items()]
                print("\n" + format_table(block, args.baseline))
                rows.extend(block)
    write_rows(args.out, rows)
    return rows


def summarise(spec: str, length: int, budget: int | None, runs: list[dict], baseline: list[dict],
              scoring_s: float | None) -> dict:
    """Medians over the repetitions, plus the median of the per-repetition prefill ratios."""
    row = dict(method=spec, prompt_tokens=length, budget=None if spec == "fullkv" else budget)
    row.update({key: statistics.median(run[key] for run in runs) for key in runs[0]})
    row["paired_prefill_ratio"] = paired_ratio(runs, baseline)
    row["compress_kv_s"] = scoring_s
    row["runs"] = runs
    return row


def paired_ratio(runs: list[dict], baseline: list[dict], key: str = "prefill_s") -> float:
    """Median over the repetitions of ``key``'s ratio to the baseline's in the same repetition."""
    return statistics.median(run[key] / base[key] for run, base in zip(runs, baseline))


def format_table(rows: list[dict], baseline: str) -> str:
    """One block of rows (one length and budget) with ratios to the ``baseline`` method's row;
    a ``peak MiB`` column when the rows carry ``peak_memory_bytes`` (device runs)."""
    base = next(row for row in rows if row["method"] == baseline)
    peak = all(row.get("peak_memory_bytes") is not None for row in rows)
    budget = next((row["budget"] for row in rows if row["budget"] is not None), None)
    lines = [
        f"{base['prompt_tokens']}-token prompt, budget {budget} (ratios vs {baseline})",
        f"{'method':>18} {'prefill s':>9} {'ratio':>6} {'paired':>6} {'decode ms/tok':>13} {'ratio':>6} "
        f"{'cache MiB':>9} {'ratio':>6} {'kept':>6} {'residual':>8} {'compress_kv s':>13}"
        + (f" {'peak MiB':>9} {'ratio':>6}" if peak else ""),
    ]
    for row in rows:
        scoring = "-" if row.get("compress_kv_s") is None else f"{row['compress_kv_s']:.3f}"
        line = (
            f"{row['method']:>18} {row['prefill_s']:>9.3f} {row['prefill_s'] / base['prefill_s']:>6.3f} "
            f"{paired_ratio(row['runs'], base['runs']):>6.3f} {1000 * row['decode_s_per_token']:>13.2f} "
            f"{row['decode_s_per_token'] / base['decode_s_per_token']:>6.3f} {row['cache_bytes'] / 2**20:>9.2f} "
            f"{row['cache_bytes'] / base['cache_bytes']:>6.4f} {row['kept_share']:>6.1%} "
            f"{row['residual_share']:>8.1%} {scoring:>13}"
        )
        if peak:
            peak_ratio = row["peak_memory_bytes"] / base["peak_memory_bytes"]
            line += f" {row['peak_memory_bytes'] / 2**20:>9.0f} {peak_ratio:>6.3f}"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
