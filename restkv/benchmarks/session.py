"""A benchmark run in one process: the loaded and patched model, greedy generation, the
compression check, and the loop over a dataset's samples.

**Generation.** Greedy, batch 1, stopping on the prompt's stop tokens, new tokens decoded
without special tokens. Query-agnostic prompts (``question_ids``) compress the context alone,
then feed the question through the compressed cache (``restkv.integrations.transformers.generation``). A multi-question
sample (``Sample.questions``) compresses its context once and answers every question from it
(``answer_many``); each answer is the one its question would get alone. ``--seed`` (a config
option) also seeds Python, NumPy and torch.

**No silent no-compression.** After each sample the cache is inspected: if the compressed
prefill was longer than the budget, every layer that the method compresses at that length must
be one restkv built and (unless its allocation keeps layers or heads whole by design,
``Allocation.may_keep_whole``) hold fewer entries than tokens seen in some KV head, else the run
stops with ``CompressionNotApplied``; every compressed layer must have been built with the run's
config, else ``CompressionMismatch``. Tokens seen / stored go in the line.

**Prompts too short to compress.** Under ``--compression_ratio`` a short prompt may keep no
more tokens than the method always keeps (its window, KVzip's sinks, the chat template and
question around the context that KVzip-style ranking keeps); the library refuses such
a row, so the sample is answered with the full cache and its line says so (``"compressed":
false`` and ``"uncompressed_reason"``: the library's refusal); the evaluators count such samples.

**Output line.** ``id, index, pred`` (the field name of LongBench's and RULER's own tools), the
adapter's ``fields``, then ``prompt_tokens, context_tokens, question_tokens, truncated,
new_tokens, kv_tokens_seen, kv_tokens_stored, kv_layers_compressed`` (then ``compressed,
uncompressed_reason`` for a sample answered with the full cache) and ``seconds``. A
multi-question sample writes one line per question (id ``<id>/<k>``, the sample's ``index``,
the sample's fields then the question's, its own token counts and cache record; ``seconds``
is the sample's time shared equally by its lines). A sample whose lines are not all written
(a run killed between them) is redone whole, and only its missing lines are written.

**Sharding.** Shard ``K`` of ``N`` runs the samples whose index ``i`` has ``i % N == K``, each
shard its own file.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
from tqdm import tqdm

from restkv.benchmarks.benchmark import Benchmark, Sample
from restkv.benchmarks.errors import CompressionMismatch, CompressionNotApplied, DataError, FlagError
from restkv.benchmarks.flags import compression_config_from_args, default_model_max_len, full_cache_config, shard_of
from restkv.benchmarks.prompts import EncodedPrompt, encode_prompt, encode_questions, stop_token_ids
from restkv.benchmarks.results import results_dir
from restkv.benchmarks.run_folder import DatasetInput, RunFolder, run_settings
from restkv.config import CompressionConfig, ConfigError
from restkv.integrations.transformers.compat import CACHE_ARGUMENT, with_cache
from restkv.integrations.transformers.context_span import set_context_span
from restkv.integrations.transformers.reconstruction_prompt import set_reconstruction_prompt

# --------------------------------------------------------------------------- generation


@dataclass(frozen=True)
class Generation:
    """One answer: its text and token ids, and the cache it was generated with."""

    text: str
    token_ids: list[int]
    cache: Any


def _greedy(tokenizer, max_new_tokens: int, stop_ids: Sequence[int], min_new_tokens: int):
    """The generation config of every answer: greedy, batch 1, stopping on ``stop_ids``."""
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        do_sample=False,
        num_beams=1,
        eos_token_id=list(stop_ids),
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0],
    )


def generate(model, tokenizer, encoded: EncodedPrompt, max_new_tokens: int,
             stop_ids: Sequence[int], min_new_tokens: int = 0) -> Generation:
    """Greedy generation; with ``question_ids``, the context is compressed alone first."""
    from transformers import DynamicCache

    from restkv.integrations.transformers.generation import generate_after_context

    settings = _greedy(tokenizer, max_new_tokens, stop_ids, min_new_tokens)
    context = torch.tensor([encoded.context_ids], device=model.device)
    if encoded.question_ids:
        question = torch.tensor([encoded.question_ids], device=model.device)
        new_ids, cache = generate_after_context(
            model, context, question, generation_config=settings, return_cache=True, context_span=encoded.context_span
        )
    else:
        cache = DynamicCache(config=model.config)
        set_context_span(cache, encoded.context_span)
        output = model.generate(
            input_ids=context, attention_mask=torch.ones_like(context), generation_config=settings, **with_cache(cache)
        )
        new_ids = output[:, context.shape[-1]:]
    token_ids = new_ids[0].tolist()
    return Generation(tokenizer.decode(token_ids, skip_special_tokens=True), token_ids, cache)


def generate_many(model, tokenizer, prompts: Sequence[EncodedPrompt], max_new_tokens: int,
                  stop_ids: Sequence[int], min_new_tokens: int = 0) -> list[Generation]:
    """Greedy answers of several questions after one context, compressed once
    (``restkv.integrations.transformers.generation.answer_many``; ``prompts`` share their ``context_ids``). Each
    generation's cache is the one its answer left: the compressed context, its question and
    its tokens."""
    from restkv.integrations.transformers.generation import answer_many

    context = torch.tensor([prompts[0].context_ids], device=model.device)
    questions = [torch.tensor([prompt.question_ids], device=model.device) for prompt in prompts]
    ends = _AnswerEnds()
    hook = model.register_forward_pre_hook(ends.see_cache, with_kwargs=True)
    try:
        new_ids = answer_many(model, context, questions, streamer=ends, context_span=prompts[0].context_span,
                              generation_config=_greedy(tokenizer, max_new_tokens, stop_ids, min_new_tokens))
    finally:
        hook.remove()
    return [Generation(tokenizer.decode(ids[0].tolist(), skip_special_tokens=True), ids[0].tolist(), cache)
            for ids, cache in zip(new_ids, ends.caches)]


class _AnswerEnds:
    """What each answer of ``answer_many`` left in the cache, which it does not return: a
    forward pre-hook on the model finds the cache, and generate's streamer protocol (``put``
    for tokens, ``end`` when an answer is done) says when to copy it (its list of layers: the
    next answer starts from fresh copies of the compressed context)."""

    def __init__(self) -> None:
        self.cache: Any = None
        self.caches: list[Any] = []

    def see_cache(self, module, args, kwargs) -> None:
        self.cache = kwargs.get(CACHE_ARGUMENT, self.cache)

    def put(self, token_ids) -> None:
        """Tokens as they come: nothing to do."""

    def end(self) -> None:
        answered = copy.copy(self.cache)
        answered.layers = list(self.cache.layers)
        self.caches.append(answered)


def _attention_modules(model) -> list[torch.nn.Module]:
    """The model's attention modules in layer order, patched or not (so an unpatched model
    cannot pass the compression check by having no patched layers)."""
    modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]
    if not modules:
        raise CompressionNotApplied(f"found no attention layers in {type(model).__name__} to check")
    return sorted(modules, key=lambda m: m.layer_idx)


def compression_record(model, config: CompressionConfig, cache, prefill_tokens: int) -> dict[str, Any]:
    """Tokens seen and stored by the cache, after checking it did what ``config`` claims.

    Raises ``CompressionNotApplied`` if a layer that had to compress the ``prefill_tokens``-token
    prefill is not one restkv built (the patch is not active), or kept every token where its
    allocation must evict in every layer (uniform budgets: some KV head of the layer must hold fewer
    tokens than it saw). An allocation that may keep a layer or a head whole by design
    (``Allocation.may_keep_whole``: DuoAttention's retrieval heads, SimLayerKV's layers that are not
    lazy) needs only the first; a model-wide one, also that some layer evicted. Raises
    ``CompressionMismatch`` if a layer was compressed with other settings than ``config`` (the
    model re-configured behind the run's back). This is the one place that reads the library's
    compression internals.
    """
    from restkv.cache import CompressedLayer, cache_report
    from restkv.integrations.transformers.steps import layer_facts
    from restkv.pipeline.plan import plan_layer

    valid = torch.ones(1, prefill_tokens, dtype=torch.bool)
    layers = model.config.num_hidden_layers
    expected = [
        module.layer_idx
        for module in _attention_modules(model)
        if plan_layer(config, valid, module.layer_idx, layers, layer_facts(module).sliding_window).compress
    ]
    reports = cache_report(cache)
    held = {layer: reports[layer] for layer in expected if layer < len(reports) and reports[layer].kind == "compressed"}
    unpatched = [layer for layer in expected if layer not in held]
    if unpatched:
        raise CompressionNotApplied(
            f"the prefill had {prefill_tokens} tokens, over the budget of --method {config.method}, but layers "
            f"{unpatched} kept every token: restkv's attention patch is not active on this model "
            "(unpatched, another model class, or a cache type restkv does not compress)"
        )
    allocator = config.allocator
    if allocator.model_wide:  # one ranking across the model may leave a layer whole: the model must evict
        whole = expected if held and not any(_evicted(report) for report in held.values()) else []
    else:
        whole = [] if allocator.may_keep_whole else [layer for layer, report in held.items() if not _evicted(report)]
    if whole:
        raise CompressionNotApplied(
            f"the prefill had {prefill_tokens} tokens, over the budget of --method {config.method}, but layers "
            f"{whole} were built by restkv but kept every token, which its allocation {allocator.name!r} never does"
        )
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, CompressedLayer) and layer.config is not None and layer.config != config:
            built, claimed = layer.config.to_dict(), config.to_dict()
            changed = [name for name in claimed if built[name] != claimed[name]]
            raise CompressionMismatch(
                f"layer {index} was compressed with {_options(built, changed)} but the run's settings say "
                f"{_options(claimed, changed)}: the model's compression was changed (configure/replace_*) after "
                "the run started"
            )
    return {
        "kv_tokens_seen": max((r.tokens_seen for r in reports), default=0),
        "kv_tokens_stored": (round(float(np.mean([r.stored_mean + r.summary_slots for r in reports])), 1)
                             if reports else 0),
        "kv_layers_compressed": sum(r.compressed for r in reports),
    }


def _evicted(report) -> bool:
    """Whether some KV head of a layer holds fewer entries (summaries included) than tokens seen."""
    return report.stored_min + report.summary_slots < report.tokens_seen


def uncompressible_reason(config: CompressionConfig, prefill_tokens: int,
                          context_span: tuple[int, int] | None = None) -> str | None:
    """Why a prefill of ``prefill_tokens`` tokens cannot be compressed under ``config``, or None.

    A ratio budget can leave a short prompt no more tokens than the method always keeps (its
    observation window, KVzip's sinks, and for a method that keeps the template around the
    prompt's ``context_span``, that template: a query-aware prompt's question); the library
    refuses to compress such a row; the runner asks the library's own plan before generating,
    answers that sample with the full cache, and records the library's reason.
    """
    from restkv.integrations.transformers.context_span import protected_span
    from restkv.pipeline.plan import plan_layer

    try:
        plan_layer(config, torch.ones(1, prefill_tokens, dtype=torch.bool),
                   context_span=protected_span(config, context_span))
    except ConfigError as refusal:
        return str(refusal)
    return None


@contextlib.contextmanager
def full_cache(model, config: CompressionConfig) -> Iterator[CompressionConfig]:
    """The model keeping every token (its config, fullkv, is yielded), then back at ``config``."""
    from restkv.integrations.transformers.patching import configure

    keep_all = configure(model, full_cache_config())
    try:
        yield keep_all
    finally:
        configure(model, config)


def _options(options: Mapping[str, Any], names: Sequence[str]) -> str:
    return ", ".join(f"{name} {options[name]!r}" for name in names)


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


def _dtype_name(args: argparse.Namespace, model) -> str:
    """The dtype the predictions are made in: the given model's, else ``--dtype`` (default as
    ``restkv.integrations.transformers.models.load_model``'s; "auto" is the checkpoint's own)."""
    if model is not None:
        return str(model.dtype).removeprefix("torch.")
    if args.dtype is not None:
        return args.dtype
    return "bfloat16" if torch.cuda.is_available() else "float32"


def load_dataset_samples(benchmark: Benchmark, args: argparse.Namespace, dataset: str, tokenizer) -> list[Sample]:
    """The dataset's samples as the adapter loads them, ids checked unique (they are the resume key)."""
    samples = benchmark.load_samples(args, dataset, tokenizer)
    seen: set = set()
    for sample in samples:
        if sample.id in seen:
            raise DataError(f"{dataset}: sample id {sample.id!r} occurs twice; ids must be unique (resume key)")
        seen.add(sample.id)
    return samples


@dataclass
class BenchmarkRun:
    """A loaded, patched model, the datasets it answers and the folder they go to."""

    benchmark: Benchmark
    args: argparse.Namespace
    config: CompressionConfig
    model: Any
    tokenizer: Any
    results: RunFolder
    inputs: dict[str, DatasetInput]
    model_max_len: int
    shard_id: int = 0
    num_shards: int = 1

    @classmethod
    def start(cls, benchmark: Benchmark, args: argparse.Namespace, datasets: Sequence[str], model=None,
              tokenizer=None) -> "BenchmarkRun":
        """Check what needs no model first (a model type restkv serves, every dataset's data, the
        folder's lock, settings and data), then load (unless given) and patch the model and write
        ``run_meta.json``. A config the model refuses (the library's ``ConfigError``, at the patch or
        at the first compressing prefill) ends the run in one line (``errors.command_line``)."""
        from transformers import AutoConfig

        from restkv.integrations.transformers.models import (check_supported, load_model, load_tokenizer,
                                                             model_path_errors, resolve_model_path)
        from restkv.integrations.transformers.patching import replace_for_model

        config = compression_config_from_args(args)
        if args.query_agnostic and config.policy.question_delimiter is not None:
            raise FlagError(f"--finch_delimiter {config.policy.question_delimiter} finds the window from the question "
                            "in the prompt; --query_agnostic (and --multi_question) compress the context before the "
                            "question is seen")
        shard_id, num_shards = shard_of(args)
        with model_path_errors(args.model_path):
            if tokenizer is None:
                tokenizer = load_tokenizer(args.model_path)
            model_config = model.config if model is not None else AutoConfig.from_pretrained(
                resolve_model_path(args.model_path))
        check_supported(model_config, args.model_path)
        inputs = {
            name: DatasetInput.of(name, load_dataset_samples(benchmark, args, name, tokenizer), args.max_num_examples)
            for name in datasets
        }
        model_max_len = (default_model_max_len(args.model_path, model_config) if args.model_max_len is None
                         else args.model_max_len)
        dtype = _dtype_name(args, model)
        settings = run_settings(args, benchmark, config, dtype, model_max_len)
        folder = results_dir(args.save_dir, args.model_path, config, args.query_agnostic, args.tag)
        results = RunFolder(folder)
        try:
            results.check(settings, list(inputs.values()))
            results.claim(datasets, shard_id, num_shards)
            set_seed(config.seed)
            if model is None:
                with model_path_errors(args.model_path):
                    model = load_model(args.model_path, args.attn_implementation, dtype, _device_map(args))
            # exactly the run's config (what configure() left before is dropped), as the model runs it (a
            # DuoAttention pattern scored on the fly names its file)
            config = replace_for_model(model, config)
            set_reconstruction_prompt(model, tokenizer)
            results.write_meta(settings, list(inputs.values()), args, model)
        except BaseException:
            results.close()
            raise
        return cls(benchmark, args, config, model, tokenizer, results, inputs, model_max_len, shard_id, num_shards)

    @property
    def folder(self) -> Path:
        return self.results.path

    def answer(self, sample: Sample) -> list[dict[str, Any]]:
        """Generate a sample's answers (one, or one per question); returns their output lines
        (``Sample.line_ids`` order) without ``id``/``index``."""
        started = time.perf_counter()
        if sample.questions:
            prompts = encode_questions(self.tokenizer, sample, self.model_max_len)
            fields = [{**sample.fields, **question.fields} for question in sample.questions]
        else:
            prompts = [encode_prompt(self.tokenizer, sample, self.model_max_len, split=self.args.query_agnostic,
                                     delimiter=self.config.policy.question_delimiter)]
            fields = [sample.fields]
        stop_ids = stop_token_ids(self.model, self.tokenizer, sample.stop_tokens)
        max_new_tokens = sample.max_new_tokens if self.args.max_new_tokens is None else self.args.max_new_tokens
        prompt_config, context_tokens = self.prompt_config(prompts[0])
        delimiters = len(prompts[0].context_ids) - context_tokens
        reason = uncompressible_reason(prompt_config, context_tokens, prompts[0].context_span)
        with contextlib.ExitStack() as stack:
            config = prompt_config if reason is None else stack.enter_context(full_cache(self.model, self.config))
            if sample.questions:
                results = generate_many(self.model, self.tokenizer, prompts, max_new_tokens, stop_ids,
                                        sample.min_new_tokens)
            else:
                results = [generate(self.model, self.tokenizer, prompts[0], max_new_tokens, stop_ids,
                                    sample.min_new_tokens)]
            records = [compression_record(self.model, config, result.cache, context_tokens) for result in results]
        seconds = round((time.perf_counter() - started) / len(results), 3)
        return [
            {
                "pred": result.text,
                **line_fields,
                "prompt_tokens": encoded.num_tokens - delimiters,
                "context_tokens": context_tokens,
                "question_tokens": len(encoded.question_ids),
                "truncated": encoded.truncated,
                "new_tokens": len(result.token_ids),
                **kv,
                **({} if reason is None else {"compressed": False, "uncompressed_reason": reason}),
                "seconds": seconds,
            }
            for result, encoded, line_fields, kv in zip(results, prompts, fields, records)
        ]

    def prompt_config(self, prompt: EncodedPrompt) -> tuple[CompressionConfig, int]:
        """The config the model compresses ``prompt`` with, and the prompt's tokens the model reads: the run's and
        all of them, or, where the method finds its window from a delimiter, the run's with the question's length
        as the window and the tokens less the delimiter (``restkv.integrations.transformers.question_window``)."""
        delimiter = self.config.policy.question_delimiter
        if delimiter is None:
            return self.config, len(prompt.context_ids)
        after = len(prompt.context_ids) - prompt.context_ids.index(delimiter) - 1
        return self.config.replace(window_size=after), len(prompt.context_ids) - 1

    def run_dataset(self, dataset: str) -> Path:
        """Answer this shard's samples of ``dataset`` that no file holds yet; returns the file.

        The samples are loaded again (``start`` kept only their digests, so a long benchmark's
        texts are not all held at once) and must be the ones ``start`` checked.
        """
        samples = load_dataset_samples(self.benchmark, self.args, dataset, self.tokenizer)
        if DatasetInput.of(dataset, samples, self.args.max_num_examples) != self.inputs[dataset]:
            raise DataError(f"{dataset}: the data changed since the run started; rerun to check them again")
        writer = self.results.writers[dataset]
        done = self.results.done(dataset)
        todo = [(index, sample) for index, sample in enumerate(samples[: self.inputs[dataset].covered])
                if index % self.num_shards == self.shard_id and not done.issuperset(sample.line_ids)]
        if not todo:  # resumed with every sample written: no empty bar
            return writer.path
        label = dataset if self.num_shards == 1 else f"{dataset} [{self.shard_id}/{self.num_shards}]"
        # leave=None: the bar stays when it is the only one, and goes under an outer one (the sweep's)
        with tqdm(todo, desc=label, unit="sample", dynamic_ncols=True, leave=None) as progress:
            for index, sample in progress:
                records = self.answer(sample)
                for line_id, record in zip(sample.line_ids, records):
                    if line_id not in done:  # a sample cut off between its lines is redone whole
                        writer.write({"id": line_id, "index": index, **record})
                progress.set_postfix(tokens=records[-1]["prompt_tokens"], stored=records[-1]["kv_tokens_stored"])
        return writer.path

    def close(self) -> None:
        """Release the folder's files (``contextlib.closing`` a run)."""
        self.results.close()
