"""Haystack text for the retrieval benchmarks (RULER's essay tasks and Needle-in-a-Haystack).

Both benchmarks were defined on Paul Graham's essays. Those are not redistributable, so:

* if a folder of essays exists (``data/PaulGrahamEssays/*.txt``, or RULER's
  ``PaulGrahamEssays.json`` with a ``text`` field), it is used, files in sorted order;
* otherwise the haystack is *synthetic prose*: English-looking sentences built from a fixed
  set of sentence patterns and the ``wonderwords`` vocabulary with a fixed seed. It is
  deterministic, generated on demand to any length, and carries no copyrighted text.

Scores on the synthetic prose are not comparable with published numbers on the essays;
``HaystackText.source`` says which one a run used, and the generators record it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.resources
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from restkv.benchmarks.errors import DataError

ESSAY_DIR = Path("data/PaulGrahamEssays")
SYNTHETIC_SOURCE = "synthetic-prose"
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


@dataclass(frozen=True)
class HaystackText:
    """The haystack's full text and where it came from (a path or ``synthetic-prose``)."""

    text: str
    source: str

    @functools.cached_property
    def words(self) -> list[str]:
        """Whitespace-normalised words, as RULER splits its essay."""
        return re.sub(r"\s+", " ", self.text).strip().split(" ")


def load_essays(essay_dir: str | Path | None = ESSAY_DIR, min_words: int = 0) -> HaystackText:
    """The essays in ``essay_dir`` if there are any, else synthetic prose of ``min_words`` words.

    ``essay_dir`` may hold ``*.txt`` files (concatenated in sorted order) or RULER's
    ``PaulGrahamEssays.json``. Texts shorter than ``min_words`` are used as they are; callers
    that need more repeat them, as RULER and the needle test do.
    """
    if essay_dir is not None:
        folder = Path(essay_dir)
        files = sorted(folder.glob("*.txt")) if folder.is_dir() else []
        if files:
            return HaystackText("".join(f.read_text(encoding="utf-8") for f in files), str(folder))
        ruler_json = folder / "PaulGrahamEssays.json"
        if ruler_json.is_file():
            return HaystackText(json.loads(ruler_json.read_text(encoding="utf-8"))["text"], str(ruler_json))
    return HaystackText(synthetic_prose(min_words), SYNTHETIC_SOURCE)


def given_essays(flag: str, folder: str | Path) -> HaystackText:
    """The essays of a folder named on the command line by ``flag``: it must exist and hold some,
    so that a typo stops the run instead of silently falling back to synthetic prose."""
    if not Path(folder).is_dir():
        raise DataError(f"{flag} {folder}: no such folder")
    haystack = load_essays(folder)
    if haystack.source == SYNTHETIC_SOURCE:
        raise DataError(f"{flag} {folder} holds no essays (*.txt files or PaulGrahamEssays.json)")
    return haystack


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


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text``: a break after ``.``, ``!`` or ``?`` followed by a capital or digit.

    RULER uses NLTK's punkt model, which is not installable offline; this rule agrees with
    it on ordinary prose and differs on abbreviations such as "e.g. The".
    """
    text = text.strip()
    return [s for s in _SENTENCE_END.split(text) if s] if text else []
