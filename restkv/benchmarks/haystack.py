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
import json
import re
from dataclasses import dataclass
from pathlib import Path

from restkv.benchmarks.errors import DataError
from restkv.benchmarks.text import synthetic_prose

ESSAY_DIR = Path("data/PaulGrahamEssays")
SYNTHETIC_SOURCE = "synthetic-prose"


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


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text``: a break after ``.``, ``!`` or ``?`` followed by a capital or digit.

    RULER uses NLTK's punkt model, which is not installable offline; this rule agrees with
    it on ordinary prose and differs on abbreviations such as "e.g. The".
    """
    text = text.strip()
    return [s for s in _SENTENCE_END.split(text) if s] if text else []
