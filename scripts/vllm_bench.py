"""Plain vLLM against vLLM with restkv, on the same needle prompts and the same small KV cache, in one run.

    .venv-vllm/bin/python scripts/vllm_bench.py --model smollm2-135m --method snapkv --compression_ratio 0.9 --check

Prefix caching is off in both engines (restkv turns it off: a compressed request's blocks no longer hold its
prefix) and no two prompts share a prefix. Each engine runs in its own process (restkv's plugin reads
``RESTKV_VLLM`` when a vLLM process starts): plain vLLM, vLLM with restkv, and with ``--check`` vLLM with restkv at
a budget above every prompt. The KV cache holds ``--kv_cache_requests`` uncompressed requests. The table: requests
running at once at the peak, preemptions, blocks per request after prefill, output tokens per second, and the
needle's exact match (its five-digit code in the reply) beside the transformers path's on the same prompts with the
same method. ``--check`` exits 1 unless (a) the budget above every prompt gives token-identical outputs to plain
vLLM, (b) every layer's and KV head's kept positions equal the transformers path's, (c) each compressed request
holds ``ceil(kept / block_size)`` blocks. Check (b) allows what two float paths (vLLM's fused kernels,
transformers' modules) can disagree on: at most 1% of the layer-heads may differ, each by a near-tie swap (at least
95% of its positions shared); the counts are printed. The last line starts with ``vllm:``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ENGINE_FLAG = "--engine_spec"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="an embedded model name or a Hugging Face folder")
    parser.add_argument("--method", default="snapkv")
    parser.add_argument("--compression_ratio", type=float, default=None, help="share of each prompt evicted")
    parser.add_argument("--max_capacity_prompts", type=int, default=None, help="tokens kept per layer and KV head")
    parser.add_argument("--window_size", type=int, default=None, help="restkv's observation window")
    parser.add_argument("--num_prompts", type=int, default=64, help="needle prompts, all submitted at once")
    parser.add_argument("--min_length", type=int, default=1400, help="shortest context in tokens")
    parser.add_argument("--max_length", type=int, default=1600, help="longest context in tokens")
    parser.add_argument("--max_tokens", type=int, default=64,
                        help="tokens generated per prompt (greedy; long enough that early requests still run while "
                        "the last ones are admitted)")
    parser.add_argument("--kv_cache_requests", type=float, default=8,
                        help="the KV cache holds this many uncompressed requests")
    parser.add_argument("--block_size", type=int, default=32,
                        help="tokens per KV cache block, for both engines (vLLM's CPU default is 128, which rounds a "
                        "140-token compressed request up to 256 slots; the CPU backend takes multiples of 32)")
    parser.add_argument("--max_num_batched_tokens", type=int, default=2048,
                        help="vLLM's token budget per step, for both engines: the prompts being prefilled hold their "
                        "whole KV until their prefill ends, so this bounds the memory compression cannot save "
                        "(smaller: prompts prefilled in more chunks)")
    parser.add_argument("--enforce_eager", action="store_true",
                        help="skip vLLM's torch.compile (engines start in seconds; for tests)")
    parser.add_argument("--check", action="store_true", help="exit 1 unless the three checks pass")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument(ENGINE_FLAG, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compression_ratio is None and args.max_capacity_prompts is None:
        args.compression_ratio = 0.9
    for flag in ("num_prompts", "min_length", "max_tokens", "max_num_batched_tokens", "block_size"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1")
    if args.max_length < args.min_length:
        parser.error("--max_length must be at least --min_length")
    if args.kv_cache_requests <= 0:
        parser.error("--kv_cache_requests must be positive")
    return args


def restkv_options(args) -> dict:
    options = {"method": args.method}
    for name in ("compression_ratio", "max_capacity_prompts", "window_size"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    return options


# ---------------------------------------------------------------------------- one engine, in its own process
def run_engine(spec: dict) -> dict:
    """Serve every prompt at once on one engine; what the table reads."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype="float32", max_model_len=spec["max_model_len"], seed=0,
              enable_prefix_caching=False,
              kv_cache_memory_bytes=spec["kv_cache_bytes"], max_num_seqs=len(spec["prompts"]), disable_log_stats=False,
              max_num_batched_tokens=spec["max_num_batched_tokens"], block_size=spec["block_size"],
              enforce_eager=spec["enforce_eager"])
    engine = llm.llm_engine
    # every request generates --max_tokens (as serving benchmarks do), so each holds its blocks as long
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, ignore_eos=True)
    for index, ids in enumerate(spec["prompts"]):
        engine.add_request(str(index), {"prompt_token_ids": ids}, params)
    peak, outputs, start = 0, {}, time.perf_counter()
    metrics = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[int(output.request_id)] = list(output.outputs[0].token_ids)
        metrics = {metric.name: metric for metric in llm.get_metrics()}
        peak = max(peak, int(metrics["vllm:num_requests_running"].value))
    elapsed = time.perf_counter() - start
    return {"peak_running": peak, "preemptions": int(metrics["vllm:num_preemptions"].value), "seconds": elapsed,
            "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
            "token_ids": [outputs[i] for i in range(len(spec["prompts"]))]}


def engine_in_process(spec: dict, restkv: dict | None, record: Path | None, work: Path, name: str) -> dict:
    env = {key: value for key, value in os.environ.items() if key not in ("RESTKV_VLLM", "RESTKV_VLLM_RECORD")}
    if restkv is not None:
        env["RESTKV_VLLM"] = json.dumps(restkv)
    if record is not None:
        env["RESTKV_VLLM_RECORD"] = str(record)
    spec_path, result_path = work / f"{name}.spec.json", work / f"{name}.result.json"
    spec_path.write_text(json.dumps({**spec, "result": str(result_path)}))
    log = work / f"{name}.log"
    print(f"[{name}] starting an engine (log: {log})", flush=True)
    with open(log, "w") as out:
        code = subprocess.call([sys.executable, __file__, ENGINE_FLAG, str(spec_path)], env=env, stdout=out,
                               stderr=subprocess.STDOUT)
    if code != 0:
        tail = log.read_text().strip().splitlines()[-3:]
        raise SystemExit(f"error: the {name} engine failed ({code}): {' | '.join(tail)}")
    return json.loads(result_path.read_text())


# ---------------------------------------------------------------------------- prompts and the transformers path
def secret_code(index: int) -> str:
    """Prompt ``index``'s needle: a five-digit code, different for every prompt."""
    return str(10000 + (index * 7919) % 90000)


def needle_prompts(tokenizer, args) -> list[list[int]]:
    """Needle-in-a-haystack prompts (the needle runner's synthetic haystack and prompt, a five-digit code as the
    needle, which the embedded 135M model retrieves with its full cache) in the chat template, lengths spread
    over ``--min_length .. --max_length``, depths over the context, each haystack from its own place in the
    text."""
    from restkv.benchmarks.haystack import HaystackText
    from restkv.benchmarks.needle import build_prompts, load_haystack

    words = load_haystack(None, 4 * args.max_length).words
    prompts = []
    for index in range(args.num_prompts):
        start = index * 997 % len(words)  # each prompt's haystack starts elsewhere: no two share a prefix
        haystack = HaystackText(" ".join(words[start:] + words[:start]), "synthetic-prose")
        length = args.min_length + (args.max_length - args.min_length) * index // max(args.num_prompts - 1, 1)
        depth = (index * 37) % 100
        prompt = build_prompts(tokenizer, haystack, [length], [depth], needle=f"\nThe secret code is "
                               f"{secret_code(index)}.\n", question="What is the secret code?")[0]
        messages = [{"role": "user", "content": prompt.context + prompt.question}]
        prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))
    return prompts


def transformers_path(folder: str, prompts: list[list[int]], options: dict, max_tokens: int) -> tuple[list, list]:
    """The same method on the same prompts through restkv's transformers path: each reply, and each prompt's
    kept positions per layer (``[H_kv][K]``)."""
    import torch
    import transformers
    from packaging.version import Version

    import restkv
    from restkv.integrations.transformers.compat import (CHECK_VARIABLE, MIN_TRANSFORMERS, UntestedTransformersVersion,
                                                         output_cache)
    from restkv.models import load_model

    if Version(transformers.__version__) < MIN_TRANSFORMERS:  # vLLM pins an older release: the reference runs on it
        os.environ[CHECK_VARIABLE] = "warn"
        warnings.simplefilter("ignore", UntestedTransformersVersion)
        print(f"[transformers] on transformers {transformers.__version__} (vLLM's pin; restkv patches 5.22+ in its "
              "own environment): check (b) compares the two paths", flush=True)
    model = load_model(folder, "sdpa", dtype="float32")
    replies, kept = [], []
    with restkv.compression(model, **options):
        for ids in prompts:
            with torch.no_grad():
                output = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                        return_dict_in_generate=True)
            replies.append(output.sequences[0, len(ids):].tolist())
            layers = restkv.kept_positions(output_cache(output))  # the prompt's kept tokens, then the generated ones
            kept.append([[[p for p in head if p < len(ids)] for head in layer.exact[0]] for layer in layers])
    return replies, kept


# ---------------------------------------------------------------------------- the run
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.engine_spec is not None:
        spec = json.loads(Path(args.engine_spec).read_text())
        Path(spec["result"]).write_text(json.dumps(run_engine(spec)))
        return 0
    from transformers import AutoConfig, AutoTokenizer

    from restkv.integrations.vllm import VllmSettingsError, read_settings
    from restkv.integrations.vllm.record import read_records
    from restkv.models import resolve_model_path

    options = restkv_options(args)
    try:
        read_settings(json.dumps(options))  # a method or option vLLM cannot serve stops here, before any model
    except VllmSettingsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    folder = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = AutoConfig.from_pretrained(folder)
    prompts = needle_prompts(tokenizer, args)
    longest = max(len(ids) for ids in prompts)
    per_request = math.ceil((longest + args.max_tokens) / args.block_size) * args.block_size
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    spec = {"model": folder, "prompts": prompts, "max_tokens": args.max_tokens,
            "max_model_len": per_request, "max_num_batched_tokens": args.max_num_batched_tokens,
            "block_size": args.block_size, "enforce_eager": args.enforce_eager,
            "kv_cache_bytes": int(args.kv_cache_requests * per_request * bytes_per_token)}
    print(f"{len(prompts)} needle prompts of {min(map(len, prompts))}-{longest} tokens; KV cache for "
          f"{args.kv_cache_requests:g} uncompressed requests ({spec['kv_cache_bytes'] / 2 ** 20:.0f} MiB)", flush=True)
    with tempfile.TemporaryDirectory(prefix="vllm_bench-") as scratch:
        work = Path(scratch)
        plain = engine_in_process(spec, None, None, work, "vllm")
        record = work / "record"
        compressed = engine_in_process(spec, options, record, work, "vllm+restkv")
        kept_records, block_records = read_records(record)
        fitting = None
        if args.check:
            fitting = engine_in_process(spec, {**{k: v for k, v in options.items() if k != "compression_ratio"},
                                               "max_capacity_prompts": longest + 1}, None, work, "budget above prompts")
    print("[transformers] the same method through restkv's transformers path", flush=True)
    reference, reference_kept = transformers_path(folder, prompts, options, args.max_tokens)

    def exact(replies) -> float:
        """The share of replies whose answer (up to the first end of turn) holds the prompt's code."""
        answers = [tokenizer.decode(ids[: ids.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in ids else ids,
                                    skip_special_tokens=True) for ids in replies]
        return 100.0 * sum(secret_code(index) in answer for index, answer in enumerate(answers)) / len(answers)

    block_size = compressed["block_size"]
    kept_blocks = {record["request_id"]: record for record in block_records}
    rows = [("plain vLLM", plain, sum(math.ceil(len(ids) / block_size) for ids in prompts) / len(prompts)),
            (f"vLLM + restkv {args.method}", compressed,
             sum(record["blocks"] for record in block_records) / max(len(block_records), 1))]
    print("\n| engine | running at peak | preemptions | blocks/request after prefill | output tok/s | needle EM % |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, result, blocks in rows:
        rate = sum(len(ids) for ids in result["token_ids"]) / result["seconds"]
        print(f"| {name} | {result['peak_running']} | {result['preemptions']} | {blocks:.1f} | {rate:.1f} | "
              f"{exact(result['token_ids']):.1f} |")
    print(f"| transformers path, restkv {args.method} | | | | | {exact(reference):.1f} |")

    failures = []
    by_prompt = {tuple(record["prompt_token_ids"]): record["positions"] for record in kept_records}
    compared, overlaps = 0, []  # the share of positions each differing layer-head shares
    for ids, layers in zip(prompts, reference_kept):
        recorded = by_prompt.get(tuple(ids))
        if recorded is None:
            continue
        for layer, heads in enumerate(layers):
            for head, positions in enumerate(heads):
                compared += 1
                served = recorded[layer][head].tolist()
                if sorted(positions) != served:
                    overlaps.append(len(set(positions) & set(served)) / max(len(positions), 1))
    differing = len(overlaps)
    if args.check:
        if fitting["token_ids"] != plain["token_ids"]:
            same = sum(a == b for a, b in zip(fitting["token_ids"], plain["token_ids"]))
            failures.append(f"(a) a budget above every prompt: {same}/{len(prompts)} outputs identical to plain vLLM")
        if compared == 0 or differing > 0.01 * compared or min(overlaps, default=1.0) < 0.95:
            failures.append(f"(b) kept positions: {differing} of {compared} layer-heads differ from the transformers "
                            f"path (least overlap {min(overlaps, default=1.0):.1%})" if compared else
                            "(b) no compressed request was recorded")
        wrong = [r for r in kept_blocks.values() if r["blocks"] != math.ceil(r["kept"] / block_size)]
        if wrong or not kept_blocks:
            failures.append(f"(c) {len(wrong)} requests hold blocks other than ceil(kept / {block_size})"
                            if kept_blocks else "(c) no compressed request released blocks")
        for failure in failures:
            print(f"check failed: {failure}")
        if not failures:
            print(f"checks passed: (a) {len(prompts)} outputs identical at a budget above every prompt; (b) "
                  f"{compared - differing} of {compared} layer-heads keep exactly the transformers path's positions"
                  + (f", {differing} differ by near-tie swaps (least overlap {min(overlaps):.1%})" if differing else "")
                  + f"; (c) {len(kept_blocks)} requests hold ceil(kept / {block_size}) blocks")
    ratio = compressed["peak_running"] / max(plain["peak_running"], 1)
    summary = {"peak_running": [plain["peak_running"], compressed["peak_running"]],
               "preemptions": [plain["preemptions"], compressed["preemptions"]],
               "needle_em": [exact(plain["token_ids"]), exact(compressed["token_ids"]), exact(reference)],
               "kept_positions_differing": [differing, compared], "failures": failures}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    print(f"vllm: {args.method} {json.dumps(options)}: {ratio:.1f}x running at peak ({compressed['peak_running']} vs "
          f"{plain['peak_running']}), preemptions {compressed['preemptions']} vs {plain['preemptions']}, needle EM "
          f"{exact(compressed['token_ids']):.1f} (transformers path {exact(reference):.1f}, plain vLLM "
          f"{exact(plain['token_ids']):.1f})"
          + ("" if not args.check else f", checks {'failed' if failures else 'passed'}"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
