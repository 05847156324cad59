"""Synthetic prose: deterministic English-looking text the library can generate anywhere.

Sentences come from a fixed set of patterns filled with the ``wonderwords`` vocabulary under a
fixed seed, so the text is reproducible, generated on demand to any length and free of
copyrighted material. The benchmarks' haystacks (``restkv.benchmarks.haystack``) and the
IndexMem trainer (``restkv.tools.train_indexmem``) read it from here.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.resources
import random
import re

_PROSE_SEED = "restkv-synthetic-prose-v1"

# Sentence patterns of the synthetic prose: {N} noun, {A} adjective, {V} verb (base form);
# {a_A} is an adjective with its indefinite article.
_PATTERNS = (
    "The {A} {N} can {V} the {N} without much effort.",
    "Most people who {V} {a_A} {N} never think about the {N} behind it.",
    "If you want to {V} the {N}, start with {a_A} {N}.",
    "{a_A_cap} {N} is often more useful than {a_A} {N}.",
    "We tried to {V} the {N} last year, and the {N} turned out to be {A}.",
    "Nobody expected the {N} to {V} the {N} so quickly.",
    "That is why the {N} matters more than the {A} {N}.",
    "In the long run, every {N} will {V} some {A} {N}.",
    "It is hard to {V} {a_A} {N} when the {N} seems {A}.",
    "Perhaps the {A} {N} should {V} the {N} first.",
    "What surprised me most was how {A} the {N} had become.",
    "You do not need {a_A} {N} to {V} the {N}.",
    "The best way to {V} the {N} is to ask the {N} what it wants.",
    "Few things are as {A} as {a_A} {N} that refuses to {V}.",
    "When the {N} began to {V}, the {A} {N} stayed where it was.",
    "A good {N} will {V} the {N} long before anyone notices.",
)


def synthetic_prose(num_words: int) -> str:
    """Deterministic prose of at least ``num_words`` words (paragraphs of 4-8 sentences).

    The text for a larger ``num_words`` starts with the text for a smaller one, so a haystack
    cut to N words is the same whatever length was asked for first.
    """
    rng = random.Random(_PROSE_SEED)
    vocab = prose_vocabulary()
    paragraphs, count = [], 0
    while count < max(num_words, 1):
        sentences = [_sentence(rng, vocab) for _ in range(rng.randint(4, 8))]
        paragraph = " ".join(sentences)
        paragraphs.append(paragraph)
        count += len(paragraph.split())
    return "\n\n".join(paragraphs) + "\n"


def _sentence(rng: random.Random, vocab: dict[str, list[str]]) -> str:
    pattern = rng.choice(_PATTERNS)
    out, pos = [], 0
    for match in re.finditer(r"\{(\w+)\}", pattern):
        out.append(pattern[pos : match.start()])
        slot = match.group(1)
        if slot in ("a_A", "a_A_cap"):
            adjective = rng.choice(vocab["A"])
            article = "an" if adjective[0] in "aeiou" else "a"
            word = f"{article.capitalize() if slot == 'a_A_cap' else article} {adjective}"
        else:
            word = rng.choice(vocab[slot])
        out.append(word)
        pos = match.end()
    out.append(pattern[pos:])
    return "".join(out)


@functools.lru_cache(maxsize=1)
def prose_vocabulary() -> dict[str, list[str]]:
    """Single lower-case words of wonderwords' noun (N), adjective (A) and verb (V) lists."""
    simple = re.compile(r"^[a-z]+$")
    return {
        slot: [w for w in wonderwords_list(name) if simple.match(w)]
        for slot, name in (("N", "nounlist.txt"), ("A", "adjectivelist.txt"), ("V", "verblist.txt"))
    }


@functools.lru_cache(maxsize=None)
def wonderwords_list(file_name: str) -> tuple[str, ...]:
    """One of wonderwords' bundled word lists (``nounlist.txt``, ``adjectivelist.txt``, ``verblist.txt``).

    RULER draws its keys and common words from these lists; the version changes the lists
    (3.0.x removed four nouns), so generators record :func:`wonderwords_version`.
    """
    try:
        assets = importlib.resources.files("wonderwords.assets")
    except ModuleNotFoundError:
        raise ImportError(
            "RULER's word lists come from the wonderwords package: pip install wonderwords "
            "(or pip install 'restkv[bench]')"
        ) from None
    lines = assets.joinpath(file_name).read_text(encoding="utf-8").splitlines()
    return tuple(line.rstrip() for line in lines if line.strip())


def wonderwords_version() -> str:
    return importlib.metadata.version("wonderwords")
