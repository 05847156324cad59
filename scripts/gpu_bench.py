"""The paper's efficiency claims on one GPU: prefill time, decode time per token, peak memory
and cache bytes of an 8B-class model at long prompts, methods side by side in one run.

    python scripts/gpu_bench.py                      # Llama-3.1-8B's shape, 32K/64K/128K, budget 1024
    python scripts/gpu_bench.py --model_shape qwen2-7b --lengths 32768 --methods fullkv snapkv restkv \
        --attn_implementation flash_attention_2
    python scripts/gpu_bench.py --model_shape tiny --lengths 256 --budget 64   # the same path on a CPU, in seconds

The model is built from its config with random weights directly on the device (nothing is
downloaded, nothing is materialised on the host first): timings and memory depend on the
shapes, not on the weights. The prompt is random token ids. Every repetition runs every
method once in a rotating order (``scripts/efficiency.py``'s interleaving); times come from
CUDA events after a synchronisation (host timers on a CPU), peak memory from
``torch.cuda.max_memory_allocated`` reset before each method's run (the weights included;
on a CPU only the cache report's bytes are known). Tables give ratios to SnapKV and to the
full cache; rows go to ``--out`` in ``scripts/efficiency.py``'s format plus
``peak_memory_bytes``, so ``visualization/visualize.py efficiency --results`` draws them.
A measurement, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Callable, TypeVar

import torch
from efficiency import check_methods, format_table, interleaved_runs, make_prompt, measure, summarise  # noqa: E402
from model_shapes import CONFIGS, build_model, shape_flag_of_old  # noqa: E402

from restkv.benchmarks.config_file import add_config_flags, parse_command_line  # noqa: E402
from restkv.benchmarks.errors import command_line  # noqa: E402
from restkv.benchmarks.flags import (ATTN_IMPLEMENTATIONS, check_attn_implementation, check_minimums,  # noqa: E402
                                     check_output_path)

sys.path.insert(0, str(Path(__file__).resolve().parent))


T = TypeVar("T")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_shape", choices=sorted(CONFIGS), default="llama-8b",
                        help="model shape (--config NAME, its earlier spelling, still chooses one)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072], help="prompt tokens")
    parser.add_argument("--methods", nargs="+", default=["fullkv", "snapkv", "restkv", "adakv", "snapkv+residual"],
                        help="METHOD or METHOD+SWITCH...")
    parser.add_argument("--budget", type=int, default=1024, help="tokens kept per layer and KV head")
    parser.add_argument("--decode_steps", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--attn_implementation", choices=ATTN_IMPLEMENTATIONS, default="sdpa")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="weights and activations (default: bfloat16 on a GPU, float32 on a CPU)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/gpu_bench.json")
    parser.add_argument("--summary", default=None, help="also write the tables to this text file")
    add_config_flags(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args, _ = parse_command_line(build_parser, shape_flag_of_old(argv))
    # Every number and every method before the model is built (one error: line from main).
    check_minimums(args, {"lengths": 1, "budget": 1, "decode_steps": 1, "repeats": 1})
    check_methods(args.methods, {length: [args.budget] for length in args.lengths})
    check_attn_implementation(args.attn_implementation)
    for flag in ("out", "summary"):
        if getattr(args, flag) is not None:
            check_output_path(getattr(args, flag), f"--{flag}")
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.dtype = DTYPES[args.dtype or ("bfloat16" if args.device.type == "cuda" else "float32")]
    return args


def cuda_seconds(run: Callable[[], T]) -> tuple[T, float]:
    """``run()`` and its seconds by CUDA events, after the device has finished its earlier work."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    result = run()
    end.record()
    end.synchronize()
    return result, start.elapsed_time(end) / 1000


def measure_on(device: torch.device) -> Callable[..., dict]:
    """``measure`` with the device's clock and, on a GPU, the peak memory of the run."""
    if device.type != "cuda":
        return measure

    def measure_cuda(model, prompt: torch.Tensor, decode_steps: int, compressing: bool) -> dict:
        gc.collect()  # the previous run's cache goes before this run's peak is counted
        torch.cuda.reset_peak_memory_stats(device)
        row = measure(model, prompt, decode_steps, compressing, timed=cuda_seconds)
        row["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        return row

    return measure_cuda


@command_line
def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    model = build_model(args.model_shape, args.dtype, args.device, args.attn_implementation,
                        max(args.lengths) + args.decode_steps + 1)
    run = measure_on(args.device)
    specs = args.methods
    baselines = [name for name in ("snapkv", "fullkv") if name in specs] or specs[:1]
    rows, tables = [], []
    with torch.no_grad():
        for length in args.lengths:
            prompt = make_prompt(None, model.config.vocab_size, length, "random").to(args.device)
            # Warm-up: every method once on a short prompt (kernels, handles, allocator pools).
            interleaved_runs(model, prompt[:, : min(length, 2 * args.budget + 64)], specs, args.budget, 1, 2, run)
            runs = interleaved_runs(model, prompt, specs, args.budget, args.repeats, args.decode_steps, run)
            block = [summarise(spec, length, args.budget, spec_runs, runs[baselines[0]], None)
                     for spec, spec_runs in runs.items()]
            for row in block:
                row.update(config=args.model_shape, dtype=str(args.dtype).removeprefix("torch."),
                           attn_implementation=args.attn_implementation, device=str(args.device))
            tables.extend(format_table(block, baseline) for baseline in baselines)
            print("\n" + "\n\n".join(tables[-len(baselines):]), flush=True)
            rows.extend(block)
            write_results(args, rows, tables)  # after every length: a later one may not finish
    print(f"wrote {args.out}")
    return rows


def write_results(args: argparse.Namespace, rows: list[dict], tables: list[str]) -> None:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    if args.summary:
        header = (f"{args.model_shape}, {str(args.dtype).removeprefix('torch.')}, {args.attn_implementation}, "
                  f"{_device_name(args.device)}, {args.repeats} repeats, {args.decode_steps} decode steps")
        Path(args.summary).write_text(header + "\n\n" + "\n\n".join(tables) + "\n")


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    main()
