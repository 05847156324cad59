"""Offline generator of RULER's synthetic tasks, in RULER's own file format.

``python -m restkv.benchmarks.ruler_data --tokenizer smollm2-135m --lengths 4096 8192 \
--tasks synthetic --num_samples 100 --out data/RULER`` writes
``data/RULER/<length>/<task>/validation.jsonl`` exactly as RULER's ``prepare.py`` lays it out
(``index, input, outputs, length, length_w_model_temp, answer_prefix`` and, for niah,
``token_position_answer``) plus a ``generation.json`` recording what the data depend on:
tokenizer, chat template, seed, haystack source and wonderwords version. niah samples also
record ``needles``: every needle inserted, ``{"key": ..., "values": [...]}`` per key in the
order drawn (the haystack of distractor needles of ``niah_multikey_2/3`` aside), which
``run_ruler.py --multi_question`` asks about one by one.

The tasks follow RULER's generators (``scripts/data/synthetic/*.py``): the same templates,
needles, haystacks, word sources, few-shot examples and answers. Differences, all deliberate:

* Length. RULER searches one haystack size per file and shrinks a sample that overflows by a
  whole increment (500 essay words), so samples can fall several hundred tokens short. Here
  each sample draws its random content once and then searches the largest haystack that
  fits, so every sample ends within one haystack unit (a word, a numbered word, or one noise
  line of about 20 tokens) of the target: within 1% from 4K tokens on.
* Length accounting. ``length`` is RULER's: tokens of ``input + answer_prefix`` (the model's
  tokenizer, no special tokens) plus the task's tokens to generate. With
  ``--chat_template`` (the default) the fit also counts the tokenizer's chat template around
  ``input`` (RULER's ``length_w_model_temp``), so the prompt the runner builds plus the
  generated tokens stay within the target; the file keeps the bare ``input``.
* Randomness. Each sample has its own RNG derived from (seed, task, length, index), so a
  sample does not depend on how many were generated; ``index`` is the sample number for
  every task (RULER's niah overwrites it with a character offset).
* Offline inputs. Without ``data/PaulGrahamEssays`` the essay tasks use the project's
  synthetic prose (see :mod:`restkv.benchmarks.haystack`); a folder given with ``--essay_dir``
  must hold essays. Sentences are split by a rule,
  not NLTK punkt. cwe adds adjective-noun compounds where RULER would open its (Git LFS)
  ``english_words.json`` (only beyond ~100K tokens). In ``niah_multikey_2/3`` distractor
  needles never reuse a real key, so every question has one answer.
* qa_1/qa_2 need SQuAD 2.0 dev (``squad.json``) and HotpotQA dev distractor
  (``hotpotqa.json``) files in ``--qa_dir``; they are not downloaded.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import string
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from restkv.benchmarks.errors import FlagError, command_line
from restkv.benchmarks.flags import check_minimums
from restkv.benchmarks.haystack import ESSAY_DIR, HaystackText, given_essays, load_essays, split_sentences
from restkv.benchmarks.prompts import chat_wrap
from restkv.benchmarks.ruler import FAMILIES, SYNTHETIC_TASKS, RulerTask, get_task, niah_prompt, parse_task_list
from restkv.benchmarks.text import wonderwords_list, wonderwords_version

NOISE_LINE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
# Insertion depths of needles in an essay haystack: 40 evenly spaced percentages.
DEPTHS = [round(100 * i / 39) for i in range(40)]
VT_ICL_LENGTH = 500
QA_DOCUMENT = "Document {i}:\n{document}"


@dataclass(frozen=True)
class Rendered:
    """One sample at one haystack size: the prompt body, its answer prefix, the gold answers and,
    for niah, every needle inserted (``{"key", "values"}``, in key order)."""

    input: str
    answer_prefix: str
    outputs: list[str]
    needles: list[dict] | None = None


class TokenCounter:
    """Counts tokens the way RULER does (the model's tokenizer, no special tokens)."""

    def __init__(self, tokenizer, use_chat_template: bool):
        self.tokenizer = tokenizer
        self.use_chat_template = use_chat_template and bool(getattr(tokenizer, "chat_template", None))

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, rendered: Rendered) -> int:
        """Tokens of the prompt the runner sends: chat-wrapped input, then the answer prefix."""
        return self.count(chat_wrap(self.tokenizer, rendered.input, self.use_chat_template) + rendered.answer_prefix)


def largest_fitting_size(measure: Callable[[int], int], budget: int, smallest: int = 1) -> int:
    """The largest size ``n >= smallest`` with ``measure(n) <= budget`` (measure grows with n).

    Two probes give a linear estimate; a galloping search brackets it and bisection finishes,
    so a 128K-token haystack costs about a dozen tokenizations.
    """
    base = measure(smallest)
    if base > budget:
        raise ValueError(f"even the smallest haystack needs {base} tokens, more than the target {budget}")
    probe = smallest + 16
    slope = max((measure(probe) - base) / 16, 1e-6)
    guess = max(smallest, smallest + int((budget - base) / slope))
    step = max(1, guess // 64)
    if measure(guess) <= budget:
        low, high = guess, guess + step
        while measure(high) <= budget:
            low, high, step = high, high + 2 * step, 2 * step
    else:
        low, high = max(smallest, guess - step), guess
        while low > smallest and measure(low) > budget:
            high, low, step = low, max(smallest, low - 2 * step), 2 * step
    # measure(low) <= budget < measure(high)
    while high - low > 1:
        middle = (low + high) // 2
        if measure(middle) <= budget:
            low = middle
        else:
            high = middle
    return low


# ----------------------------------------------------------------------------- word sources


@functools.lru_cache(maxsize=1)
def _key_words() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """RULER's "words" keys are adjective-noun pairs from wonderwords' lists."""
    adjectives, nouns = wonderwords_list("adjectivelist.txt"), wonderwords_list("nounlist.txt")
    return tuple(sorted(set(adjectives))), tuple(sorted(set(nouns)))


@functools.lru_cache(maxsize=1)
def _common_words_vocabulary() -> tuple[str, ...]:
    """cwe's vocabulary: wonderwords nouns, adjectives and verbs, deduplicated and sorted."""
    words = wonderwords_list("nounlist.txt") + wonderwords_list("adjectivelist.txt") + wonderwords_list("verblist.txt")
    return tuple(sorted(set(words)))


def random_value(rng: random.Random, kind: str) -> str:
    """A needle key or value: a 7-digit number, an adjective-noun word, or a uuid4."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        adjectives, nouns = _key_words()
        return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}; choose numbers, words or uuids")


def _insert_at_fractions(lines: list[str], items: Sequence[str], fractions: Sequence[float]) -> list[str]:
    """``lines`` with ``items[i]`` inserted at relative position ``fractions[i]`` (order kept)."""
    out = list(lines)
    positions = sorted(int(f * len(lines)) for f in fractions)
    for position, item in sorted(zip(positions, items), key=lambda pair: pair[0], reverse=True):
        out.insert(position, item)
    return out


def _essay_context(haystack: HaystackText, num_words: int, inserts: Sequence[str], depths: Sequence[int]) -> str:
    """RULER's essay haystack: the first ``num_words`` words, ``inserts`` between sentences at ``depths`` %."""
    words = haystack.words
    if num_words > len(words):
        words = words * math.ceil(num_words / len(words))
    sentences = split_sentences(" ".join(words[:num_words]))
    cuts = [0, *sorted(int(len(sentences) * d / 100) for d in depths), len(sentences)]
    parts = []
    for i in range(1, len(cuts)):
        parts.append(" ".join(sentences[cuts[i - 1] : cuts[i]]))
        if i - 1 < len(inserts):
            parts.append(inserts[i - 1])
    return " ".join(parts)


class _Stream:
    """An endless list drawn on demand from its own RNG, so its first n items never change."""

    def __init__(self, seed: int, draw: Callable[[random.Random], str]):
        self._rng = random.Random(seed)
        self._draw = draw
        self._items: list[str] = []

    def take(self, n: int) -> list[str]:
        while len(self._items) < n:
            self._items.append(self._draw(self._rng))
        return self._items[:n]


# ----------------------------------------------------------------------------- task builders
# A builder draws a sample's random content once and returns (render, smallest size), where
# render(size) builds the sample with a haystack of that size.


@dataclass
class BuildContext:
    """What builders share within one (task, length) file."""

    task: RulerTask
    length: int
    seed: int
    counter: TokenCounter
    haystack: HaystackText | None
    qa_dir: Path


def _build_niah(rng: random.Random, ctx: BuildContext):
    args = ctx.task.args
    type_k, type_v = args["type_needle_k"], args["type_needle_v"]
    num_k = max(args["num_needle_k"], args["num_needle_q"])
    keys, values, needles = [], [], []
    for _ in range(num_k):
        keys.append(random_value(rng, type_k))
        values.append([random_value(rng, type_v) for _ in range(args["num_needle_v"])])
        needles += [NEEDLE.format(type_needle_v=type_v, key=keys[-1], value=v) for v in values[-1]]
    rng.shuffle(needles)
    queried = rng.sample(range(num_k), args["num_needle_q"])
    queries = [keys[i] for i in queried]
    answers = [value for i in queried for value in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]

    recorded = [{"key": key, "values": list(key_values)} for key, key_values in zip(keys, values)]

    haystack_type = args["type_haystack"]
    if haystack_type == "essay":
        depths = rng.sample(DEPTHS, len(needles))
    else:
        fractions = [rng.random() for _ in needles]
    if haystack_type == "needle":
        used_keys = set(keys)

        def distractor(stream_rng: random.Random) -> str:
            key = random_value(stream_rng, type_k)
            while key in used_keys:
                key = random_value(stream_rng, type_k)
            return NEEDLE.format(type_needle_v=type_v, key=key, value=random_value(stream_rng, type_v))

        distractors = _Stream(rng.getrandbits(64), distractor)

    def render(size: int) -> Rendered:
        if haystack_type == "essay":
            context = _essay_context(ctx.haystack, size, needles, depths)
        else:
            lines = [NOISE_LINE] * size if haystack_type == "noise" else distractors.take(size)
            context = "\n".join(_insert_at_fractions(lines, needles, fractions))
        text, prefix = niah_prompt(type_v, query, len(answers), context)
        return Rendered(text, prefix, list(answers), recorded)

    return render, 1


def _vt_chain(rng: random.Random, num_chains: int, num_hops: int, name_length: int, value: str | None):
    """RULER's variable chains: ``VAR A = 12345``, ``VAR B = VAR A `` ...; names are distinct."""
    names: list[str] = []
    while len(names) < num_chains * (num_hops + 1):
        name = "".join(rng.choices(string.ascii_uppercase, k=name_length))
        if name not in names:
            names.append(name)
    chains, variables = [], []
    for c in range(num_chains):
        chain_vars = names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
        first_value = value if value is not None else str(rng.randrange(10000, 99999))
        chain = [f"VAR {chain_vars[0]} = {first_value}"]
        chain += [f"VAR {chain_vars[j + 1]} = VAR {chain_vars[j]} " for j in range(num_hops)]
        chains.append(chain)
        variables.append(chain_vars)
    return variables, chains


def _build_vt(rng: random.Random, ctx: BuildContext):
    args = ctx.task.args
    if args["type_haystack"] != "noise":
        raise ValueError("vt is generated on RULER's noise haystack only")
    num_chains, num_hops = args["num_chains"], args["num_hops"]
    icl_hops = min(10, num_hops)
    icl_size, icl_fractions = _vt_icl_layout(ctx.counter, ctx.seed, num_chains, icl_hops)
    # RULER's randomize_icl: the example keeps its layout, with new names and a new value.
    icl_variables, icl_chains = _vt_chain(rng, num_chains, icl_hops, 3, str(rng.randrange(10000, 99999)))
    icl = _vt_solved_example(icl_chains, icl_variables, icl_fractions, icl_size)

    variables, chains = _vt_chain(rng, num_chains, num_hops, 5, None)
    fractions = [[rng.random() for _ in chain] for chain in chains]

    def render(size: int) -> Rendered:
        text, prefix = _vt_question(chains, fractions, size)
        return Rendered(icl + "\n" + text, prefix, list(variables[0]))

    return render, 1


def _vt_question(chains: list[list[str]], fractions: list[list[float]], num_noise: int) -> tuple[str, str]:
    """(input, answer prefix) of a vt instance: the chains inserted in ``num_noise`` noise lines."""
    family = FAMILIES["variable_tracking"]
    lines = [NOISE_LINE] * num_noise
    for chain, chain_fractions in zip(chains, fractions):
        positions = sorted(int(f * len(lines)) for f in chain_fractions)
        for j, (position, statement) in enumerate(zip(positions, chain)):
            lines.insert(position + j, statement)
    context = "\n".join(lines).replace(". \n", ".\n")
    value = chains[0][0].split("=")[-1].strip()
    num_v = len(chains[0])
    return (
        family.template.format(context=context, query=value, num_v=num_v),
        family.answer_prefix.format(query=value, num_v=num_v),
    )


def _vt_solved_example(chains, variables, fractions, num_noise: int) -> str:
    """A vt instance followed by its answer, as RULER's few-shot example."""
    text, prefix = _vt_question(chains, fractions, num_noise)
    return text + prefix + " " + " ".join(variables[0]) + "\n"


@functools.lru_cache(maxsize=8)
def _vt_icl_layout(counter: TokenCounter, seed: int, num_chains: int, num_hops: int) -> tuple[int, list]:
    """Noise size and chain positions of the ~500-token few-shot example (one per file, as RULER)."""
    rng = random.Random(f"ruler-vt-icl:{seed}")
    variables, chains = _vt_chain(rng, num_chains, num_hops, 3, "12345")
    fractions = [[rng.random() for _ in chain] for chain in chains]
    size = largest_fitting_size(
        lambda n: counter.count(_vt_solved_example(chains, variables, fractions, n)), VT_ICL_LENGTH
    )
    return size, fractions


def _build_cwe(rng: random.Random, ctx: BuildContext):
    args = ctx.task.args
    family = ctx.task.family
    num_cw = args["num_cw"]
    # RULER shrinks the lists below 4K tokens.
    if ctx.length < 4096:
        shot_words, shot_repeats, main_repeats = 20, (3, 1), (6, 1)
    else:
        shot_words, shot_repeats, main_repeats = 40, (10, 3), (args["freq_cw"], args["freq_ucw"])
    vocabulary = _common_words_vocabulary()
    full_template = family.template + family.answer_prefix
    shots = []
    for _ in range(args["num_fewshot"]):
        words = rng.sample(vocabulary, shot_words)
        context = _numbered_list(_repeat_and_shuffle(words, num_cw, shot_repeats, rng.getrandbits(64)))
        shots.append(full_template.format(context=context, query="") + " " + _numbered_list(words[:num_cw]))
    shot_text = "\n".join(shots)
    # The first n words of one random order: a larger haystack only adds words.
    order = rng.sample(vocabulary, len(vocabulary))
    compounds_rng = random.Random(rng.getrandbits(64))
    shuffle_seed = rng.getrandbits(64)

    def words_for(count: int) -> list[str]:
        if count > len(order):  # RULER's english_words.json case, beyond ~100K tokens
            seen = set(order)
            while len(order) < count:
                compound = random_value(compounds_rng, "words")
                if compound not in seen:
                    seen.add(compound)
                    order.append(compound)
        return order[:count]

    def render(size: int) -> Rendered:
        words = words_for(size)
        context = _numbered_list(_repeat_and_shuffle(words, num_cw, main_repeats, shuffle_seed))
        text = shot_text + "\n" + family.template.format(context=context, query="")
        return Rendered(text, family.answer_prefix, list(words[:num_cw]))

    return render, num_cw + 1


def _repeat_and_shuffle(words: Sequence[str], num_common: int, repeats: tuple[int, int], seed: int) -> list[str]:
    common, uncommon = list(words[:num_common]), list(words[num_common:])
    items = common * repeats[0] + uncommon * repeats[1]
    random.Random(seed).shuffle(items)
    return items


def _numbered_list(words: Sequence[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


def zeta(alpha: float) -> float:
    """Riemann zeta for alpha > 1 (Euler-Maclaurin; fwe's normaliser, without scipy)."""
    if alpha <= 1:
        raise ValueError(f"fwe's alpha must be > 1, got {alpha}")
    n = 64
    head = sum(k**-alpha for k in range(1, n))
    tail = n ** (1 - alpha) / (alpha - 1) + 0.5 * n**-alpha + alpha * n ** (-alpha - 1) / 12
    return head + tail


def _build_fwe(rng: random.Random, ctx: BuildContext):
    args = ctx.task.args
    family = ctx.task.family
    alpha, word_length = args["alpha"], args["coded_wordlen"]
    vocab_size = max(5, (ctx.length - family.tokens_to_generate) // 50)
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=word_length)))
    ranked = sorted(vocab)
    rng.shuffle(ranked)
    ranked[0] = "..."  # the most frequent "word" is noise
    shuffle_seed = rng.getrandbits(64)
    normaliser = zeta(alpha)

    def render(size: int) -> Rendered:
        words = [w for rank, w in enumerate(ranked, 1) for _ in range(int(size * rank**-alpha / normaliser))]
        random.Random(shuffle_seed).shuffle(words)
        text = family.template.format(context=" ".join(words), query="")
        return Rendered(text, family.answer_prefix, ranked[1:4])

    return render, 1


@functools.lru_cache(maxsize=2)
def _qa_dataset(path: Path, dataset: str) -> tuple[list[dict], list[str]]:
    """RULER's reading of SQuAD 2.0 dev (answerable questions) or HotpotQA dev (distractor)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if dataset == "squad":
        documents = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
        index = {doc: i for i, doc in enumerate(documents)}
        questions = []
        for article in data["data"]:
            article_docs = [index[p["context"]] for p in article["paragraphs"]]
            for paragraph in article["paragraphs"]:
                gold = index[paragraph["context"]]
                for qa in paragraph["qas"]:
                    if not qa.get("is_impossible", False):
                        questions.append(
                            {
                                "query": qa["question"],
                                "outputs": [a["text"] for a in qa["answers"]],
                                "context": [gold],
                                "more_context": [i for i in article_docs if i != gold],
                            }
                        )
        return questions, documents
    documents = sorted({f"{title}\n{''.join(sents)}" for d in data for title, sents in d["context"]})
    index = {doc: i for i, doc in enumerate(documents)}
    questions = [
        {
            "query": d["question"],
            "outputs": [d["answer"]],
            "context": [index[f"{title}\n{''.join(sents)}"] for title, sents in d["context"]],
            "more_context": [],
        }
        for d in data
    ]
    return questions, documents


def missing_qa_file(task: str, qa_dir: str | Path) -> str | None:
    """What a qa task misses in ``qa_dir`` (None when its file is there, or the task is not qa)."""
    spec = get_task(task)
    if spec.family_name != "qa":
        return None
    dataset = spec.args["dataset"]
    path = Path(qa_dir) / f"{dataset}.json"
    if path.is_file():
        return None
    source = "SQuAD 2.0 dev (dev-v2.0.json)" if dataset == "squad" else "HotpotQA dev distractor"
    return f"{task} needs {source} at {path}; it is not downloaded automatically"


def check_lengths(tasks: Sequence[str], lengths: Sequence[int], flag: str = "--lengths") -> None:
    """Every length must leave each task room for its generated tokens (``FlagError`` naming ``flag``)."""
    for length in lengths:
        for task in tasks:
            to_generate = get_task(task).tokens_to_generate
            if length <= to_generate:
                raise FlagError(f"{flag} {length} leaves no room for {task}'s {to_generate} generated tokens")


def _build_qa(rng: random.Random, ctx: BuildContext, sample_index: int):
    dataset = ctx.task.args["dataset"]
    path = ctx.qa_dir / f"{dataset}.json"
    if (missing := missing_qa_file(ctx.task.name, ctx.qa_dir)) is not None:
        raise FileNotFoundError(missing)
    questions, documents = _qa_dataset(path, dataset)
    if sample_index >= len(questions):
        raise ValueError(f"{ctx.task.name}: sample {sample_index} asked, {path} has {len(questions)} questions")
    question = questions[sample_index]
    gold = question["context"]
    related = rng.sample(question["more_context"], len(question["more_context"]))
    excluded = set(gold) | set(related)
    others = [i for i in rng.sample(range(len(documents)), len(documents)) if i not in excluded]
    distractors = related + others
    shuffle_seed = rng.getrandbits(64)
    family = ctx.task.family

    def render(size: int) -> Rendered:
        extra = size - len(gold)
        chosen = gold + (distractors * math.ceil(extra / max(1, len(distractors))))[:extra] if distractors else gold
        docs = [documents[i] for i in chosen]
        random.Random(shuffle_seed).shuffle(docs)
        context = "\n\n".join(QA_DOCUMENT.format(i=i + 1, document=d) for i, d in enumerate(docs))
        text = family.template.format(context=context, query=question["query"])
        return Rendered(text, family.answer_prefix, list(question["outputs"]))

    return render, len(gold)


# ----------------------------------------------------------------------------- generation


def sample_rng(seed: int, task: str, length: int, index: int) -> random.Random:
    """The RNG of one sample; string seeds hash with SHA-512, so this is stable across runs."""
    return random.Random(f"ruler:{seed}:{task}:{length}:{index}")


def generate_sample(ctx: BuildContext, index: int) -> dict:
    """One RULER sample fitted to ``ctx.length`` (prompt tokens + tokens to generate)."""
    rng = sample_rng(ctx.seed, ctx.task.name, ctx.length, index)
    family = ctx.task.family_name
    if family == "niah":
        render, smallest = _build_niah(rng, ctx)
    elif family == "variable_tracking":
        render, smallest = _build_vt(rng, ctx)
    elif family == "common_words_extraction":
        render, smallest = _build_cwe(rng, ctx)
    elif family == "freq_words_extraction":
        render, smallest = _build_fwe(rng, ctx)
    else:
        render, smallest = _build_qa(rng, ctx, index)
    to_generate = ctx.task.tokens_to_generate
    budget = ctx.length - to_generate
    try:
        size = largest_fitting_size(lambda n: ctx.counter.prompt(render(n)), budget, smallest)
    except ValueError as error:
        raise FlagError(f"{ctx.task.name} cannot fit {ctx.length} tokens: {error}") from None
    rendered = render(size)
    record = {
        "index": index,
        "input": rendered.input,
        "outputs": rendered.outputs,
        "length": ctx.counter.count(rendered.input + rendered.answer_prefix) + to_generate,
        "length_w_model_temp": ctx.counter.prompt(rendered) + to_generate,
        "answer_prefix": rendered.answer_prefix,
    }
    if family == "niah":
        offset = rendered.input.find(rendered.outputs[0])
        record["token_position_answer"] = ctx.counter.count(rendered.input[:offset])
        record["needles"] = rendered.needles
    return record


def generate_task(
    task: str,
    length: int,
    num_samples: int,
    tokenizer,
    *,
    seed: int = 42,
    use_chat_template: bool = True,
    essay_dir: str | Path | None = ESSAY_DIR,
    qa_dir: str | Path = "data",
    first_index: int = 0,
) -> list[dict]:
    """``num_samples`` samples (indices ``first_index``...) of a RULER task at ``length`` tokens."""
    ctx = _build_context(task, length, tokenizer, seed, use_chat_template, essay_dir, qa_dir)
    return [generate_sample(ctx, index) for index in range(first_index, first_index + num_samples)]


def _build_context(task, length, tokenizer, seed, use_chat_template, essay_dir, qa_dir) -> BuildContext:
    spec = get_task(task)
    check_lengths([task], [length])
    haystack = None
    if spec.args.get("type_haystack") == "essay":
        haystack = load_essays(essay_dir, min_words=length)
    return BuildContext(spec, length, seed, TokenCounter(tokenizer, use_chat_template), haystack, Path(qa_dir))


def generation_meta(task: str, length: int, num_samples: int, tokenizer_name: str, tokenizer, *, seed: int,
                    use_chat_template: bool, essay_dir, qa_dir) -> dict:
    """What a data file depends on; a file is regenerated when any of it changes."""
    from restkv import __version__

    spec = get_task(task)
    meta = {
        "generator": "restkv.benchmarks.ruler_data",
        "restkv_version": __version__,
        "task": task,
        "max_seq_length": length,
        "num_samples": num_samples,
        "seed": seed,
        "tokenizer": tokenizer_name,
        "chat_template": TokenCounter(tokenizer, use_chat_template).use_chat_template,
        "tokens_to_generate": spec.tokens_to_generate,
        "wonderwords": wonderwords_version(),
    }
    if spec.family_name == "niah":  # files written before they held "needles" are regenerated
        meta["needles_recorded"] = True
    if spec.args.get("type_haystack") == "essay":
        meta["haystack"] = load_essays(essay_dir, min_words=0).source
    if spec.family_name == "qa":
        meta["qa_file"] = str(Path(qa_dir) / f"{spec.args['dataset']}.json")
    return meta


def write_task(out_dir: str | Path, task: str, length: int, num_samples: int, tokenizer, tokenizer_name: str, *,
               seed: int = 42, use_chat_template: bool = True, essay_dir: str | Path | None = ESSAY_DIR,
               qa_dir: str | Path = "data", overwrite: bool = False) -> tuple[Path, bool]:
    """Write ``<out_dir>/<length>/<task>/validation.jsonl`` and ``generation.json``.

    Returns (path, written); an existing file made with the same settings is kept, like
    RULER's prepare.py skipping a complete file.
    """
    folder = Path(out_dir) / str(length) / task
    data_path, meta_path = folder / "validation.jsonl", folder / "generation.json"
    meta = generation_meta(task, length, num_samples, tokenizer_name, tokenizer, seed=seed,
                           use_chat_template=use_chat_template, essay_dir=essay_dir, qa_dir=qa_dir)
    if not overwrite and data_path.is_file() and meta_path.is_file():
        existing_meta = json.loads(meta_path.read_text(encoding="utf-8"))
        with open(data_path, encoding="utf-8") as handle:
            lines = sum(1 for line in handle if line.strip())
        if existing_meta == meta and lines == num_samples:
            return data_path, False
    samples = generate_task(task, length, num_samples, tokenizer, seed=seed, use_chat_template=use_chat_template,
                            essay_dir=essay_dir, qa_dir=qa_dir)
    folder.mkdir(parents=True, exist_ok=True)
    partial = data_path.with_suffix(".jsonl.partial")
    with open(partial, "w", encoding="utf-8") as handle:
        for sample in samples:
            handle.write(json.dumps(sample, ensure_ascii=False) + "\n")
    os.replace(partial, data_path)
    meta_path.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return data_path, True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m restkv.benchmarks.ruler_data",
        description="Generate RULER's synthetic tasks offline, in RULER's data format, for a tokenizer.",
    )
    parser.add_argument("--tokenizer", required=True, help="model whose tokenizer measures the length "
                        "(embedded name such as smollm2-135m, a local folder or a hub id)")
    parser.add_argument("--lengths", type=int, nargs="+", required=True,
                        help="target lengths: prompt tokens + tokens to generate")
    parser.add_argument("--tasks", nargs="+", default=list(SYNTHETIC_TASKS),
                        help="task names (comma or space separated); 'synthetic' = the 11 offline tasks, "
                        "'all' adds qa_1/qa_2")
    parser.add_argument("--num_samples", type=int, default=500, help="samples per task and length (RULER: 500)")
    parser.add_argument("--out", default="data/RULER", help="output root: <out>/<length>/<task>/validation.jsonl")
    parser.add_argument("--seed", type=int, default=42, help="random seed (RULER: 42)")
    parser.add_argument("--chat_template", action=argparse.BooleanOptionalAction, default=True,
                        help="count the tokenizer's chat template (if it has one) in the length, as the runner "
                        "applies it")
    parser.add_argument("--essay_dir", default=None,
                        help="folder of Paul Graham essays (*.txt or PaulGrahamEssays.json), which must hold some "
                        f"(default: {ESSAY_DIR} if present, else synthetic prose)")
    parser.add_argument("--qa_dir", default="data", help="folder with squad.json / hotpotqa.json for qa_1 / qa_2")
    parser.add_argument("--overwrite", action="store_true", help="regenerate files that already exist")
    return parser


@command_line
def main(argv: Sequence[str] | None = None) -> list[Path]:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # everything that needs no tokenizer
        tasks = parse_task_list(args.tasks)
        check_minimums(args, {"num_samples": 1})
        check_lengths(tasks, args.lengths)
        for task in tasks:
            if (missing := missing_qa_file(task, args.qa_dir)) is not None:
                raise FlagError(f"--qa_dir: {missing}")
        if args.essay_dir is not None:
            given_essays("--essay_dir", args.essay_dir)
    except ValueError as error:  # FlagError, DataError (a bad --essay_dir), or an unknown task
        parser.error(str(error))
    essay_dir = ESSAY_DIR if args.essay_dir is None else args.essay_dir
    from restkv.integrations.transformers.models import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    written = []
    for length in args.lengths:
        for task in tasks:
            path, fresh = write_task(args.out, task, length, args.num_samples, tokenizer, args.tokenizer,
                                     seed=args.seed, use_chat_template=args.chat_template,
                                     essay_dir=essay_dir, qa_dir=args.qa_dir, overwrite=args.overwrite)
            print(f"{'wrote' if fresh else 'kept '} {path} ({args.num_samples} samples)", flush=True)
            written.append(path)
    return written


if __name__ == "__main__":
    main()
