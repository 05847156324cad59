"""Held-out evaluation text: four kinds of text no learned scorer is trained on, each with one fact to ask about.

The learned scorers are trained on ``restkv.learned.training_text`` (encyclopedic, technical and
chronicle prose). They are judged here on what that corpus holds none of, each from its own
generator, word lists and seed space (``SEED_SPACE``, the type's name, the seed and the sample's
index), so no two types and no two seeds draw the same stream:

* ``code``: a Python-like module of functions and classes with identifiers and constants; the
  question asks the value a constant is assigned;
* ``records``: an order log, one order per line with labelled fields; the question asks the tracking
  number of the one order a given customer placed;
* ``dialogue``: speaker turns of a team's chat; the question asks a code one speaker gave;
* ``news``: several short news reports; the question asks a figure one organisation announced.

A sample (``held_out_samples``) is a context of about the asked number of tokens with the fact at
a random depth, the question and the gold answer (exact match and answer NLL read it). The fact's
key appears once in the context. ``held_out_sequences`` gives the same contexts as token lists of an
exact length, for a trainer's held-out check. ``restkv.benchmarks.overlap`` measures that they share
(almost) no n-gram with the training text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

#: the prefix of every held-out seed; the type's name follows, so types never share a stream
SEED_SPACE = "restkv-heldout-v1"


@dataclass(frozen=True)
class HeldOutSample:
    """A context holding one fact, the question about it and its gold answer."""

    context: str
    question: str
    answer: str


@dataclass(frozen=True)
class _Fact:
    text: str  # the unit of text that states it
    key: str  # what the question names: it must appear in no other unit
    question: str
    answer: str


@dataclass(frozen=True)
class _TextType:
    header: Callable[[random.Random], str]  # what opens the context
    unit: Callable[[random.Random], str]  # one filler unit (a function, a row, a turn, a report)
    fact: Callable[[random.Random], _Fact]
    separator: str


def _pick(rng: random.Random, words: str) -> str:
    return rng.choice(words.split())


def _digits(rng: random.Random, low: int = 1000, high: int = 99999) -> str:
    return str(rng.randint(low, high))


# ----------------------------------------------------------------------------- code

_VERBS = "load parse merge flush render resolve encode decode validate schedule rotate compact fetch stream index"
_NOUNS = "buffer record segment token manifest ledger session payload snapshot cursor bucket shard frame queue"
_TYPES = "int str float bool bytes"


def _identifier(rng: random.Random) -> str:
    return f"{_pick(rng, _VERBS)}_{_pick(rng, _NOUNS)}"


def _constant_name(rng: random.Random) -> str:
    return f"{_pick(rng, _NOUNS).upper()}_{_pick(rng, 'LIMIT TIMEOUT_MS RETRIES WIDTH OFFSET CAPACITY SALT')}"


def _code_unit(rng: random.Random) -> str:
    noun, other = _pick(rng, _NOUNS), _pick(rng, _NOUNS)
    if rng.random() < 0.3:
        fields = "\n".join(f"        self.{_pick(rng, _NOUNS)}_{i} = {_pick(rng, _NOUNS)}"
                           for i in range(rng.randint(2, 4)))
        return (f"class {noun.capitalize()}{other.capitalize()}:\n    def __init__(self, {noun}, {other}):\n"
                f"{fields}\n\n    def {_identifier(rng)}(self):\n"
                f"        return len(self.{noun}_0) % {rng.randint(2, 97)}\n")
    lines = [f"def {_identifier(rng)}({noun}: {_pick(rng, _TYPES)}, {other}=None):",
             f"    if {other} is None:", f"        {other} = {_constant_name(rng)}",
             f"    for index, item in enumerate({noun}):",
             f"        if index > {rng.randint(2, 500)}:", "            break",
             f"        {other} = {_identifier(rng)}(item, {other})", f"    return {other}"]
    body = lines if rng.random() < 0.6 else lines[:3] + lines[-1:]  # with or without its loop
    return "\n".join(body) + "\n"


def _code_fact(rng: random.Random) -> _Fact:
    name, value = _constant_name(rng) + f"_{rng.randint(2, 9)}", _digits(rng)
    return _Fact(f"{name} = {value}\n", name, f"In the code above, what value is assigned to {name}?", value)


# ----------------------------------------------------------------------------- records

_FIRST = "Amara Bruno Chiara Dmitri Esther Farid Greta Hiro Ines Jonas Keiko Lars Maya Nikolai Olga Pablo Rania Sven"
_LAST = "Abbott Berg Castro Dumont Eriksen Fischer Gallo Haas Iyer Jansen Kowalski Lund Moreau Novak Ortiz Pryce"
_CITIES = "Lisbon Tampere Kraków Osaka Leeds Porto Graz Tucson Ghent Malmö Valencia Winnipeg Brno Cork Bergen"
_PRODUCTS = "desk-lamp kettle headset router monitor stapler backpack blender drill tripod scanner heater printer"


def _order_id(rng: random.Random) -> str:
    return f"ORD-{rng.randint(100000, 999999)}"


def _row(rng: random.Random, order: str, customer: str | None = None) -> tuple[str, str]:
    """An order line (by ``customer``, default a random one) and its tracking number."""
    tracking = str(rng.randint(1000, 9999))
    date = f"2019-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    customer = customer or f"{_pick(rng, _FIRST)} {_pick(rng, _LAST)}"
    product, quantity, city = _pick(rng, _PRODUCTS), rng.randint(1, 9), _pick(rng, _CITIES)
    total = f"{rng.randint(5, 900)}.{rng.randint(0, 99):02d}"
    return (f"Tracking number for {customer}'s order: {tracking} ({product} x{quantity}, {city}, {date}, "
            f"order {order}, total {total})"), tracking


#: the asked order's customer: names no other line uses, so the question names one line
_ASKED_FIRST = "Wilhelmina Bartholomew Ottoline Cosimo Philippa Leopold Henrietta Ambrose"
_ASKED_LAST = "Featherstone Quenby Ravenscroft Tolliver Winterbourne Ashcombe Pendragon Marchbank"


def _records_fact(rng: random.Random) -> _Fact:
    customer = f"{_pick(rng, _ASKED_FIRST)} {_pick(rng, _ASKED_LAST)}"
    row, tracking = _row(rng, _order_id(rng), customer)
    return _Fact(row, customer, f"What is the tracking number for {customer}'s order?", tracking)


# ----------------------------------------------------------------------------- dialogue

_SPEAKERS = "Tomasz Leila Quentin Priya Rafael Yuki Beatrix Oskar Nadia Emeka"
_REMARKS = (
    "did anyone see the {thing} this morning?", "I'll be late, the {thing} is acting up again.",
    "can we move the sync to after lunch?", "thanks, that fixed it.", "who has the keys to the {thing}?",
    "lol no, that was last week.", "sure, ping me when you're done.", "the {thing} needs a new {thing} again.",
    "I left my charger next to the {thing}.", "ok, I'm heading out now, see you tomorrow.",
    "does the {thing} still make that noise?", "send me the photo when you get a sec.",
)
_THINGS = "printer van projector coffee-machine badge-reader fridge elevator wifi dishwasher scooter"


def _turn(rng: random.Random, text: str) -> str:
    return f"[{rng.randint(8, 18):02d}:{rng.randint(0, 59):02d}] {_pick(rng, _SPEAKERS)}: {text}"


def _dialogue_unit(rng: random.Random) -> str:
    remark = rng.choice(_REMARKS)
    while "{thing}" in remark:
        remark = remark.replace("{thing}", _pick(rng, _THINGS), 1)
    return _turn(rng, remark)


def _dialogue_fact(rng: random.Random) -> _Fact:
    speaker, place = _pick(rng, _SPEAKERS), f"{_pick(rng, 'north south back side')} {_pick(rng, 'door gate cage')}"
    code = _digits(rng, 1000, 9999) + rng.choice("ABCDE#*")
    turn = f"[{rng.randint(8, 18):02d}:{rng.randint(0, 59):02d}] {speaker}: fyi the code for the {place} is now {code}"
    return _Fact(turn, f"the {place}", f"In the chat above, what is the new code for the {place}?", code)


# ----------------------------------------------------------------------------- news

_ORGS = ("Halvorsen Freight", "Meridian Dairy Cooperative", "Quillstone Bank", "Tarrow Wind Farms", "Ostrava Metals",
         "Lumen Pharmacies", "Brightwater Utilities", "Kestrel Airlines", "Norcastle Council", "Vayu Textiles")
_TOWNS = "Ashby Carrow Dunmere Eastfold Fenwick Glenholm Harlow Kilbride Lowther Marsden Penrith Redlake"
_TOPICS = (
    "{org} reported that quarterly sales in {town} rose {pct} percent, helped by a mild {month}.",
    "Residents of {town} objected to a plan by {org} to close a branch on the high street.",
    "Shares of {org} fell {pct} percent after a regulator opened an inquiry into its accounts.",
    "A spokesperson for {org} declined to comment on reports of talks with a rival.",
    "Officials in {town} said roadworks near the station would last until late {month}.",
    "{org} named a new chief executive, its third in {small} years.",
    "Heavy rain flooded several streets in {town}, and schools stayed closed on Tuesday.",
    "Analysts expect {org} to announce cost cuts when it reports results in {month}.",
)
_MONTHS = "January February March April May June July August September October November December"


def _news_sentence(rng: random.Random, template: str, org: str) -> str:
    return template.format(org=org, town=_pick(rng, _TOWNS), pct=rng.randint(2, 40), month=_pick(rng, _MONTHS),
                           small=rng.randint(2, 9))


def _report(rng: random.Random, org: str, sentences: list[str]) -> str:
    headline = f"{org.upper()}: {_pick(rng, 'UPDATE BRIEFING MARKETS LOCAL BUSINESS')}"
    dateline = f"{_pick(rng, _TOWNS).upper()}, {_pick(rng, _MONTHS)} {rng.randint(1, 28)} (Wire) -"
    return f"{headline}\n{dateline} " + " ".join(sentences)


def _news_unit(rng: random.Random) -> str:
    org = rng.choice(_ORGS)
    return _report(rng, org, [_news_sentence(rng, rng.choice(_TOPICS), org) for _ in range(rng.randint(3, 6))])


def _news_fact(rng: random.Random) -> _Fact:
    org, town, count = rng.choice(_ORGS), _pick(rng, _TOWNS), _digits(rng, 120, 9800)
    claim = f"{org} said it would hire {count} workers at a new depot in {town}."
    filler = [_news_sentence(rng, rng.choice(_TOPICS), org) for _ in range(rng.randint(2, 4))]
    filler.insert(rng.randint(0, len(filler)), claim)
    return _Fact(_report(rng, org, filler), f"depot in {town}",
                 f"According to the reports above, {org} said it would hire how many workers at a new depot in "
                 f"{town}?", count)


_GENERATORS = {
    "code": _TextType(lambda rng: f"# module {_pick(rng, _NOUNS)}_{_pick(rng, _NOUNS)}.py\nimport os\n",
                      _code_unit, _code_fact, "\n\n"),
    "records": _TextType(lambda rng: "Shipping log (one order per line)",
                         lambda rng: _row(rng, _order_id(rng))[0], _records_fact, "\n"),
    "dialogue": _TextType(lambda rng: f"#{_pick(rng, 'ops office facilities lab')}-team channel",
                          _dialogue_unit, _dialogue_fact, "\n"),
    "news": _TextType(lambda rng: "Today's wire reports", _news_unit, _news_fact, "\n\n"),
}
#: the held-out text types, in the order reports list them
HELD_OUT_TYPES = tuple(_GENERATORS)


def _check_type(text_type: str) -> _TextType:
    if text_type not in _GENERATORS:
        raise ValueError(f"unknown held-out text type {text_type!r}; choose from {', '.join(HELD_OUT_TYPES)}")
    return _GENERATORS[text_type]


def _sample(text_type: str, tokenizer, context_tokens: int, seed: int, index: int, purpose: str) -> HeldOutSample:
    kind = _check_type(text_type)
    rng = random.Random(f"{SEED_SPACE}:{text_type}:{purpose}:{seed}:{index}")
    fact = kind.fact(rng)
    units, count = [], len(tokenizer(kind.header(rng) + fact.text, add_special_tokens=False).input_ids)
    while count < context_tokens:
        unit = kind.unit(rng)
        if fact.key in unit:
            continue
        units.append(unit)
        count += len(tokenizer(unit + kind.separator, add_special_tokens=False).input_ids)
    units.insert(rng.randint(0, len(units)), fact.text)
    context = kind.separator.join([kind.header(rng), *units]) + "\n"
    return HeldOutSample(context, fact.question, fact.answer)


def held_out_samples(text_type: str, tokenizer, num_samples: int, context_tokens: int,
                     seed: int) -> list[HeldOutSample]:
    """``num_samples`` samples of ``text_type`` (one of ``HELD_OUT_TYPES``), each a context of about
    ``context_tokens`` tokens (at least that many, by less than one unit more) with one fact, its question and
    answer; sample ``i`` is the same whatever the count asked for."""
    return [_sample(text_type, tokenizer, context_tokens, seed, index, "sample") for index in range(num_samples)]


def held_out_sequences(tokenizer, text_type: str, num_sequences: int, seq_len: int, seed: int) -> list[list[int]]:
    """``num_sequences`` token lists of exactly ``seq_len`` tokens of ``text_type`` (no special tokens), from a
    stream of their own (not the samples')."""
    sequences = []
    for index in range(num_sequences):
        context = _sample(text_type, tokenizer, seq_len + 16, seed, index, "sequence").context
        ids = tokenizer(context, add_special_tokens=False).input_ids
        if len(ids) < seq_len:  # a unit's tokens counted alone may exceed what it adds to the whole text
            context = _sample(text_type, tokenizer, 2 * seq_len, seed, index, "sequence").context
            ids = tokenizer(context, add_special_tokens=False).input_ids
        sequences.append(ids[:seq_len])
    return sequences
