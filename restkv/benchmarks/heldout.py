"""Compression on text no learned scorer saw: exact match, answer NLL, prefill time and KV bytes per method.

    python -m restkv.benchmarks.heldout --threads 1   # every query-agnostic method at 5%, 10% and 20% kept
    python -m restkv.benchmarks.heldout --methods kvzip kvzip+reconstruction_prompt=none \\
        --compression_ratios 0.9 0.8             # one ablation
    python -m restkv.benchmarks.heldout --query_aware --methods snapkv restkv

The samples are ``restkv.benchmarks.heldout_text``'s: ``--num_samples`` contexts of about
``--context_tokens`` tokens of each ``--types`` type (code, records, dialogue, news; generators and
seeds of their own, sharing no n-gram with the corpus the learned scorers are trained on), each with
one fact, its question and its answer. The context is the user turn of the chat template; by default
it is compressed alone and the question follows as new tokens (query-agnostic: what a cached
document asked many questions needs); ``--query_aware`` compresses the prompt with its question.

Each sample and configuration gives: **exact match** (the gold answer appears in the greedy answer of
at most ``--max_new_tokens`` tokens: RULER's string match), **answer NLL** (the gold answer's mean
negative log-likelihood per token, teacher-forced after the question: finer than exact match on a
small model), the **prefill**'s time (the compression included: KVzip's repetition of the context,
ReST-KV's scoring; ``--clock cpu``, the default, counts the process's CPU seconds, steady on a shared
machine) and the **KV bytes** the cache holds after it. The full cache runs first, then every method at
every budget (``--compression_ratios``). The table gives per configuration each type's exact match
and NLL, their means, the prefill time as a multiple of SnapKV's at the same budget on the same
samples (``x snapkv``; run ``snapkv`` to have it), and the cache's size.

One line per (configuration, sample) goes to ``<save_dir>/<setting>_<context_tokens>/records.jsonl``
as it is measured, with the configuration's full config and the fingerprint of every file it reads;
a rerun skips what is there, so an interrupted run resumes, and processes given different
``--types`` may share the folder. A measurement is found again by its config, not by the spec that
named it: two spellings of one config share it, and a spec whose config changed (a default, a
retrained weights file) is measured anew. The folder keeps one set of settings (model, lengths,
seed, generation, clock, threads; ``settings.json``): a rerun with others stops (``RunMismatch``:
use another ``--save_dir``). The summary goes to ``summary.csv`` and
``.json`` beside the records, the exact-match rows to the results table ``heldout_table`` (.csv,
.json, .png: exact match against the share kept; ``restkv.benchmarks.tables``).
"""

from __future__ import annotations

import argparse
import copy
import csv
import functools
import hashlib
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm

from restkv.benchmarks import tables
from restkv.benchmarks.benchmark import Sample
from restkv.benchmarks.config_file import add_config_flags, parse_command_line
from restkv.benchmarks.errors import FlagError, RunMismatch, command_line
from restkv.benchmarks.flags import ATTN_IMPLEMENTATIONS, check_attn_implementation, check_minimums, check_output_path
from restkv.benchmarks.heldout_text import HELD_OUT_TYPES, HeldOutSample, held_out_samples
from restkv.benchmarks.prompts import EncodedPrompt, encode_prompt, stop_token_ids
from restkv.benchmarks.run_folder import file_fingerprint, library_versions
from restkv.benchmarks.scoring import format_table
from restkv.cache import cache_report
from restkv.config import CompressionConfig, ConfigError, config_from_spec
from restkv.integrations.transformers.generation import continuation_nll, greedy_continuation, prefill_with_logits
from restkv.integrations.transformers.models import check_model_path, load_for_scoring
from restkv.integrations.transformers.patching import compression

#: every query-agnostic method the library has a cheap or a reference form of, ReST-KV and its preset, and SnapKV
#: for the time ratio; kvzap ranked across the model as KVzip is (its own per-head budget and 32-token window lose
#: most of what its scores know, and at 5% of 1024 tokens the window and the template fill the budget)
DEFAULT_METHODS = ("snapkv", "expected_attention", "learned_zip", "kvzap+allocation=model_ranked+window_size=0",
                   "kvzip", "restkv", "restkv_recon")
#: how ``--clock`` times the prefill
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}
FULL = "fullkv"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m restkv.benchmarks.heldout", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default="smollm2-135m")
    parser.add_argument("--types", nargs="+", default=list(HELD_OUT_TYPES), choices=HELD_OUT_TYPES, metavar="TYPE",
                        help=f"held-out text types (default: all: {' '.join(HELD_OUT_TYPES)})")
    parser.add_argument("--num_samples", type=int, default=5, help="samples per type (default: %(default)s)")
    parser.add_argument("--context_tokens", type=int, default=1024,
                        help="tokens of each context, about (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the samples' seed (default: %(default)s)")
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                        help="method specs (snapkv, kvzip+reconstruction_prompt=none, restkv+allocation=model_ranked), "
                        "each run at every budget after the full cache (default: %(default)s)")
    parser.add_argument("--compression_ratios", type=float, nargs="+", default=[0.95, 0.9, 0.8],
                        help="fractions of each prompt removed (default: %(default)s: 5%%, 10%%, 20%% kept)")
    parser.add_argument("--query_aware", action="store_true",
                        help="compress the prompt with its question in it (default: the context alone, before it)")
    parser.add_argument("--max_new_tokens", type=int, default=32, help="tokens of each answer at most "
                        "(default: %(default)s)")
    parser.add_argument("--attn_implementation", default="sdpa", choices=ATTN_IMPLEMENTATIONS)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                        help="cpu: CPU seconds of the process (default; steady on a shared machine), wall: host clock")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--save_dir", default="results/heldout", help="(default: %(default)s)")
    add_config_flags(parser)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags, every configuration built and the folder's settings checked before any model work."""
    args, _ = parse_command_line(build_parser, argv)
    check_minimums(args, {"num_samples": 1, "context_tokens": 64, "max_new_tokens": 1, "threads": 1})
    if FULL in args.methods:
        raise FlagError("--methods: the full cache always runs first; leave fullkv out")
    if len(set(args.methods)) != len(args.methods):
        raise FlagError(f"--methods names a spec twice: {' '.join(args.methods)}")
    for ratio in args.compression_ratios:
        for spec in args.methods:
            config_from_spec(spec, compression_ratio=ratio)  # a ConfigError names the flag
    check_model_path(args.model_path)
    check_attn_implementation(args.attn_implementation)
    check_output_path(args.save_dir, "--save_dir", folder=True)
    return args


def run_dir(args: argparse.Namespace) -> Path:
    """``<save_dir>/<setting>_<context_tokens>``: the two settings and lengths never share records."""
    return Path(args.save_dir) / f"{'aware' if args.query_aware else 'agnostic'}_{args.context_tokens}"


def configurations(args: argparse.Namespace) -> list[tuple[str, float | None]]:
    """(method spec, compression ratio) of every configuration: the full cache, then each budget's methods."""
    return [(FULL, None)] + [(spec, ratio) for ratio in args.compression_ratios for spec in args.methods]


def budget_label(ratio: float | None) -> str:
    return "full" if ratio is None else f"{round(100 * (1 - ratio))}%"


def build_config(spec: str, ratio: float | None) -> CompressionConfig:
    return config_from_spec(spec) if ratio is None else config_from_spec(spec, compression_ratio=ratio)


def config_record(config: CompressionConfig) -> dict[str, Any]:
    """What a configuration's results depend on: its config and the content of every file it reads."""
    return {"config": json.loads(json.dumps(config.to_dict(), default=str)),
            "files": {name: file_fingerprint(path) for name, path in config.files().items()}}


def folder_settings(args: argparse.Namespace, model) -> dict[str, Any]:
    return {"model_path": args.model_path, "context_tokens": args.context_tokens, "seed": args.seed,
            "query_aware": args.query_aware, "max_new_tokens": args.max_new_tokens,
            "attn_implementation": args.attn_implementation, "dtype": str(model.dtype), "clock": args.clock,
            "threads": torch.get_num_threads()}


class Records:
    """The folder's ``records.jsonl``, read once and appended to line by line, and its ``settings.json``."""

    def __init__(self, folder: Path, settings: dict[str, Any]) -> None:
        self.folder, self.path = folder, folder / "records.jsonl"
        self.done: dict[tuple, dict] = {}
        if self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    record = json.loads(line)
                    self.done[self.key(record)] = record
        settings_path = folder / "settings.json"
        if settings_path.is_file() and self.done:
            previous = json.loads(settings_path.read_text(encoding="utf-8"))
            changed = [f"{name}: {previous.get(name)!r} -> {value!r}" for name, value in settings.items()
                       if previous.get(name) != value]
            if changed:
                raise RunMismatch(f"{folder} holds records of other settings ({'; '.join(changed)}); use another "
                                  "--save_dir")
        folder.mkdir(parents=True, exist_ok=True)
        settings_path.write_text(json.dumps({**settings, "versions": library_versions()}, indent=2) + "\n",
                                 encoding="utf-8")

    @staticmethod
    def key(record: dict) -> tuple:
        return fingerprint(record), record["type"], record["index"]

    def check_samples(self, digests: dict[tuple[str, int], str]) -> None:
        """``RunMismatch`` when the folder holds records of another sample under a (type, index) of ``digests``
        (the held-out generators changed since)."""
        for record in self.done.values():
            expected = digests.get((record["type"], record["index"]))
            if expected is not None and record["sample"] != expected:
                raise RunMismatch(f"{self.folder} holds records of another {record['type']} sample {record['index']} "
                                  "(the held-out text changed since); use another --save_dir")

    def add(self, record: dict) -> None:
        self.done[self.key(record)] = record
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


def fingerprint(described: dict[str, Any]) -> str:
    """What identifies a configuration's measurements: its config and files (``config_record``), not the spec that
    named it, so ``kvzip`` and ``kvzip+reconstruction_prompt=none`` share records while a default changed since
    (another config under the same spec) is measured anew. A common option the config leaves idle
    (``--reconstruction_prompt`` of a window scorer) does not count."""
    return _fingerprint_of(json.dumps({"config": described["config"], "files": described["files"]}, sort_keys=True))


@functools.lru_cache(maxsize=None)
def _fingerprint_of(content: str) -> str:
    """``fingerprint`` of a record's config and files as JSON: each distinct config is rebuilt once (to find its
    idle options), however many records hold it."""
    described = json.loads(content)
    config = described["config"]
    idle = CompressionConfig.from_any({name: value for name, value in config.items() if value is not None})
    config.update(dict.fromkeys(idle.idle_run_options()))
    normalised = json.dumps({"config": config, "files": described["files"]}, sort_keys=True)
    return hashlib.sha256(normalised.encode()).hexdigest()[:16]


def sample_digest(sample: HeldOutSample) -> str:
    return hashlib.sha256("\x00".join((sample.context, sample.question, sample.answer)).encode()).hexdigest()[:16]


def encode(tokenizer, sample: HeldOutSample, query_aware: bool) -> EncodedPrompt:
    """The chat template's user turn holding the context then the question (split: query-agnostic)."""
    as_sample = Sample(id="", context=sample.context, question=f"\n\n{sample.question}", max_new_tokens=0)
    return encode_prompt(tokenizer, as_sample, max_tokens=10**9, split=not query_aware)


@torch.no_grad()
def measure(model, tokenizer, encoded: EncodedPrompt, answer: str, max_new_tokens: int, stop_ids: set[int],
            clock: Callable[[], float]) -> dict[str, Any]:
    """One compressed prefill, timed, then read twice from the same compressed state: the gold answer's NLL and
    the greedy answer."""
    prompt = torch.tensor([encoded.context_ids])
    question = torch.tensor([encoded.question_ids]) if encoded.question_ids else None
    gold = torch.tensor([tokenizer(" " + answer, add_special_tokens=False).input_ids])
    follows = (question.shape[-1] if question is not None else 0) + max(max_new_tokens, gold.shape[-1])
    start = clock()
    cache, logits = prefill_with_logits(model, prompt, context_span=encoded.context_span, appends=follows)
    seconds = clock() - start
    reports = cache_report(cache)
    compressed = [copy.copy(layer) for layer in cache.layers]
    nll = continuation_nll(model, cache, logits, prompt.shape[-1], gold, question)
    cache.layers[:] = compressed
    answer_ids = greedy_continuation(model, cache, logits, prompt.shape[-1], question, max_new_tokens, stop_ids)
    generated = tokenizer.decode(answer_ids, skip_special_tokens=True)
    seen = sum(report.tokens_seen for report in reports if report.kind != "state")
    stored = sum(report.stored_mean for report in reports if report.kind != "state")
    return {"prediction": generated, "exact_match": float(answer in generated), "nll": float(nll.mean()),
            "prefill_seconds": seconds, "kv_bytes": sum(report.used_nbytes for report in reports),
            "kv_kept": stored / seen if seen else None, "prompt_tokens": prompt.shape[-1]}


def run(args: argparse.Namespace, model=None, tokenizer=None) -> tuple[list[dict], dict[tuple[str, str], str]]:
    """Measure every configuration on every sample not yet in the folder; returns every record of the folder and,
    per (spec, budget) that could not run (a budget too small for the tokens the method protects), why."""
    model, tokenizer = load_for_scoring(args.model_path, args.attn_implementation, args.threads, model, tokenizer)
    records = Records(run_dir(args), folder_settings(args, model))
    samples = [(text_type, index, sample) for text_type in args.types
               for index, sample in enumerate(held_out_samples(text_type, tokenizer, args.num_samples,
                                                               args.context_tokens, args.seed))]
    records.check_samples({(text_type, index): sample_digest(sample) for text_type, index, sample in samples})
    encoded = {(text_type, index): encode(tokenizer, sample, args.query_aware) for text_type, index, sample in samples}
    stop_ids = set(stop_token_ids(model, tokenizer))
    runs = configurations(args)
    skipped: dict[tuple[str, str], str] = {}
    with tqdm(total=len(runs) * len(samples), unit="sample", dynamic_ncols=True) as progress:
        for spec, ratio in runs:
            budget, config = budget_label(ratio), build_config(spec, ratio)
            described = config_record(config)
            measured_as = fingerprint(described)
            progress.set_description(f"{spec} {budget}")
            for position, (text_type, index, sample) in enumerate(samples):
                if (measured_as, text_type, index) not in records.done:
                    try:
                        with compression(model, config):
                            measured = measure(model, tokenizer, encoded[(text_type, index)], sample.answer,
                                               args.max_new_tokens, stop_ids, CLOCKS[args.clock])
                    except ConfigError as error:  # a budget too small for what the method protects: the next one
                        skipped[(spec, budget)] = str(error)
                        progress.update(len(samples) - position)
                        break
                    records.add({"method": spec, "budget": budget, "compression_ratio": ratio, "type": text_type,
                                 "index": index, "sample": sample_digest(sample), "answer": sample.answer,
                                 **measured, **described})
                progress.update()
    return list(records.done.values()), skipped


def summary_rows(args: argparse.Namespace, records: Sequence[dict]) -> list[dict[str, Any]]:
    """Per configuration (full cache first, then per budget in method order): each type's exact match (%) and NLL,
    their means, the prefill seconds, the prefill as a multiple of SnapKV's at that budget (the samples both ran),
    the cache's MB and the share of the prompt it kept. Only the records of ``args``'s types and samples count."""
    wanted = {(text_type, index) for text_type in args.types for index in range(args.num_samples)}
    by_config: dict[str, list[dict]] = {}
    for record in records:
        if (record["type"], record["index"]) in wanted:
            by_config.setdefault(fingerprint(record), []).append(record)
    rows = []
    for spec, ratio in configurations(args):
        mine = by_config.get(fingerprint(config_record(build_config(spec, ratio))), [])
        if not mine:
            continue
        row: dict[str, Any] = {"method": spec, "budget": budget_label(ratio), "compression_ratio": ratio}
        for text_type in args.types:
            of_type = [record for record in mine if record["type"] == text_type]
            row[f"em {text_type}"] = _mean([100 * record["exact_match"] for record in of_type])
            row[f"nll {text_type}"] = _mean([record["nll"] for record in of_type])
        row["em"] = _mean([100 * record["exact_match"] for record in mine])
        row["nll"] = _mean([record["nll"] for record in mine])
        row["prefill s"] = _mean([record["prefill_seconds"] for record in mine])
        snapkv = [] if ratio is None else by_config.get(fingerprint(config_record(build_config("snapkv", ratio))), [])
        row["x snapkv"] = _time_ratio(mine, snapkv)
        row["kv MB"] = _mean([record["kv_bytes"] / 2**20 for record in mine])
        row["kv kept"] = _mean([record["kv_kept"] for record in mine if record["kv_kept"] is not None])
        row["samples"] = f"{len(mine)}/{len(wanted)}"
        rows.append(row)
    return rows


def _mean(values: list[float]) -> float | None:
    return round(statistics.mean(values), 3) if values else None


def _time_ratio(records: list[dict], snapkv: list[dict]) -> float | None:
    """Total prefill time of ``records`` over SnapKV's on the samples both hold."""
    theirs = {(record["type"], record["index"]): record["prefill_seconds"] for record in snapkv}
    shared = [record for record in records if (record["type"], record["index"]) in theirs]
    if not shared:
        return None
    return round(sum(record["prefill_seconds"] for record in shared)
                 / sum(theirs[(record["type"], record["index"])] for record in shared), 3)


def table_rows(args: argparse.Namespace, summary: Sequence[dict]) -> list[dict[str, Any]]:
    """The exact-match rows of the results table (``restkv.benchmarks.tables``): one per type, then the mean."""
    setting = tables.QUERY_AWARE if args.query_aware else tables.QUERY_AGNOSTIC
    rows = []
    for line in summary:
        method, _, options = line["method"].partition("+")
        described = {"benchmark": f"heldout_{args.context_tokens}", "model": args.model_path, "setting": setting,
                     "method": method, "options": options or None, "budget": None,
                     "compression_ratio": line["compression_ratio"], "kv_kept": line["kv kept"],
                     "expected": args.num_samples, "run": str(run_dir(args))}
        count = int(line["samples"].split("/")[0])
        for text_type in args.types:
            rows.append({**described, "task": text_type, "score": line[f"em {text_type}"], "n": args.num_samples})
        rows.append({**described, "task": tables.AVERAGE, "score": line["em"], "n": count,
                     "expected": args.num_samples * len(args.types)})
    return rows


def report(args: argparse.Namespace, summary: Sequence[dict]) -> str:
    setting = "query-aware" if args.query_aware else "query-agnostic (the context compressed before the question)"
    head = (f"held-out text, {args.model_path}, {args.context_tokens}-token contexts, {args.num_samples} samples per "
            f"type, {setting}; exact match % (the gold answer in the answer) and answer NLL per token (lower is "
            f"better); prefill by the {args.clock} clock")
    em_columns = ["budget", *(f"em {t}" for t in args.types), "em", "nll", "prefill s", "x snapkv", "kv MB",
                  "kv kept", "samples"]
    nll_columns = ["budget", *(f"nll {t}" for t in args.types), "nll"]
    return "\n".join([head, format_table(list(summary), em_columns, first="method"), "",
                      format_table(list(summary), nll_columns, first="method")])


@command_line
def main(argv: Sequence[str] | None = None, model=None, tokenizer=None) -> list[dict]:
    """The command line; ``model``/``tokenizer`` skip loading (tests). Returns the summary rows."""
    args = parse_args(argv)
    records, skipped = run(args, model, tokenizer)
    summary = summary_rows(args, records)
    print("\n" + report(args, summary))
    for (spec, budget), reason in skipped.items():
        print(f"  {spec} at {budget} kept not run: {reason}")
    folder = run_dir(args)
    (folder / "summary.json").write_text(tables.strict_json({"rows": [tables.finite(row) for row in summary]}) + "\n",
                                         encoding="utf-8")
    _write_csv(folder / "summary.csv", summary)
    written = tables.write_results(table_rows(args, summary), Path(args.save_dir) / "heldout_table",
                                   title=f"{args.model_path}, held-out text, {args.context_tokens} tokens")
    print(f"(summary: {folder / 'summary.csv'}; table: {written['csv']}; figure: {written.get('png', 'none')})")
    return summary


def _write_csv(path: Path, rows: Sequence[dict]) -> None:
    columns = list(dict.fromkeys(name for row in rows for name in row))
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows({name: "" if row.get(name) is None else row[name] for name in columns} for row in rows)


if __name__ == "__main__":
    main()
