"""The learned scorers' training text: generated here, sharing nothing with what they are evaluated on.

A learned scorer that is fitted on the text it is later scored on looks better than it is. This
corpus is produced by its own generator, with its own word lists (written in this module, not
taken from the benchmarks' prose, RULER's wonderwords lists or any package's documentation) and
its own sentence structures, in three registers: encyclopedic entries about invented places,
species and devices; technical procedures; and chronicles told in the past tense. Each sequence
is a run of such documents with facts woven in (codes, quantities, invented names, dates),
the details a later question asks for and a repetition must copy.

None of it is code, a table, a dialogue or news: those are the held-out types
(``restkv.benchmarks.heldout_text``), and ``restkv.benchmarks.overlap`` measures that the two
share (almost) no n-gram. ``training_sequences`` is what the trainers read.
"""

from __future__ import annotations

import random

#: the prefix of every sequence's seed: no other generator in the project draws from this space
SEED_SPACE = "restkv-training-text-v1"

_SYLLABLES = ("ka", "lo", "mir", "then", "vash", "ul", "dre", "sen", "oth", "bri", "nar", "quel", "tum", "ziv",
              "ar", "el", "is", "ond", "rav", "sil", "gor", "pen", "mau", "tek", "fi", "ros", "dun", "ya", "cor",
              "vel", "hab", "ix", "om", "tra", "wen", "zo")

_WORDS = {
    # things in the world the entries describe
    "creature": ("heron", "beetle", "lichen", "salamander", "moth", "otter", "fern", "sedge", "finch", "lamprey",
                 "toad", "mussel", "orchid", "wren", "marten", "sponge", "clam", "vole"),
    "landform": ("valley", "plateau", "estuary", "ridge", "basin", "delta", "moor", "fjord", "peninsula", "gorge",
                 "lagoon", "steppe", "escarpment", "atoll", "marsh", "terrace"),
    "settlement": ("hamlet", "port town", "mining town", "market village", "river city", "hill fort", "abbey town",
                   "ferry landing", "garrison"),
    "device": ("pump", "loom", "gearbox", "kiln", "winch", "sextant", "boiler", "sluice gate", "press", "turbine",
               "lathe", "bellows", "regulator", "dredge", "crane", "furnace"),
    "part": ("valve", "bearing", "gasket", "spindle", "flywheel", "ratchet", "piston", "nozzle", "coupling", "lever",
             "hinge", "seal", "filter", "shaft", "flange", "spring"),
    "material": ("copper", "slate", "oak", "bronze", "linen", "basalt", "tallow", "clay", "tin", "granite", "hemp",
                 "pewter", "cedar", "glass", "wool", "iron"),
    "trade": ("weavers", "salt merchants", "ferrymen", "glassblowers", "surveyors", "tanners", "shipwrights",
              "beekeepers", "cartographers", "masons", "potters", "chandlers"),
    "quality": ("narrow", "damp", "brittle", "fertile", "remote", "crowded", "sheltered", "windswept", "ancient",
                "orderly", "modest", "prosperous", "shallow", "steep", "quiet", "sturdy", "pale", "dense"),
    "action_past": ("founded", "surveyed", "rebuilt", "abandoned", "fortified", "mapped", "drained", "flooded",
                    "restored", "enlarged", "divided", "annexed", "repaired", "settled"),
    "motion_past": ("travelled", "sailed", "rode", "climbed", "marched", "drifted", "hurried", "wandered"),
    "feeling": ("relief", "unease", "pride", "suspicion", "gratitude", "weariness", "curiosity", "resolve"),
    "weather": ("a cold drizzle", "a heavy fog", "a dry easterly wind", "the first snow", "a long heat",
                "a spring flood", "steady rain", "a bright frost"),
    "season": ("spring", "summer", "autumn", "winter"),
    "month": ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
              "November", "December"),
    "unit": ("kilograms", "litres", "metres", "hectares", "tonnes", "kilometres", "crowns", "bushels"),
    "measure": ("pressure", "temperature", "torque", "clearance", "flow rate", "tension", "voltage", "speed"),
    "measure_unit": ("kPa", "degrees", "newton-metres", "millimetres", "litres per minute", "newtons", "volts",
                     "turns per minute"),
    "tool": ("torque wrench", "feeler gauge", "soft mallet", "pair of pliers", "brass drift", "hand lamp",
             "grease gun", "scraper"),
    "role": ("archivist", "engineer", "captain", "magistrate", "botanist", "quartermaster", "abbess", "surveyor",
             "smith", "clerk", "pilot", "physician"),
}

# One structure per template, in three registers; {name}/{place} are invented, {year} and {number} drawn.
_ENCYCLOPEDIC = (
    "{place} is a {quality} {settlement} on the edge of a {landform}, known for its {trade}.",
    "The {quality} {landform} east of {place} covers about {number} {unit} and floods every {season}.",
    "{place} was {action_past} in {year} by {name}, whose descendants held it for {small} generations.",
    "Its population reached {number} in {year}, after a census ordered by the {role} {name}.",
    "The {creature} of the {landform} is {quality} and rarely seen outside {place}.",
    "Local {trade} still work with {material} and {material}, as they have since {year}.",
    "A {material} bridge, rebuilt in {year}, links the old quarter of {place} with the {landform}.",
    "Specimens of the {quality} {creature} were first described by the {role} {name} in {year}.",
    "Under the charter of {year}, the {trade} of {place} paid their dues in {material}.",
    "The register of {place} lists the {settlement} under the number {code}.",
    "By {year} the {landform} had been {action_past}, and the {trade} moved to {place}.",
    "Scholars trace the name {place} to an older word for a {quality} {landform}.",
)
_TECHNICAL = (
    "Step {small}: close the {part} of the {device} and check that the {measure} stays below {number} {mu}.",
    "Before the {device} is started, inspect every {part} for wear; a worn {part} must be replaced.",
    "The {device} of series {code} uses a {material} {part} rated for {number} {mu}.",
    "Remove the {part} with a {tool}, keeping the {part} in place until the {measure} has fallen.",
    "If the {measure} exceeds {number} {mu}, stop the {device} and record the reading in the log.",
    "Fit the new {part} so that its marked side faces the {part}, then tighten it by hand.",
    "Part number {code} replaces the {material} {part} of models built before {year}.",
    "The {measure} should settle within {small} minutes; if it does not, the {part} is leaking.",
    "Service intervals: every {number} hours, grease the {part} and clean the {part}.",
    "Calibrate the {device} at a {measure} of {number} {mu} using a {tool}.",
    "Warning: never open the {device} while its {part} is under load.",
    "The manufacturer, {name} and {name}, issued revision {code} of this procedure in {month} {year}.",
)
_CHRONICLE = (
    "In the {season} of {year} the {role} {name} {motion_past} from {place} to {place}.",
    "The journey took {small} days through {weather}, and {small} of the party fell ill.",
    "At {place} the {trade} received them with {feeling}, though food was scarce.",
    "{name} wrote that the {landform} was {quality} and that the {creature} had vanished from it.",
    "On {day} {month} {year} the {settlement} of {place} was {action_past} by order of {name}.",
    "They carried {number} {unit} of {material}, sealed under the mark {code}.",
    "{name} never returned to {place}; the {role} {name} took charge of the {trade} in {year}.",
    "By nightfall {weather} had set in, and the {role} ordered the {device} to be brought inside.",
    "It was {name} who first {action_past} the {landform}, a task that cost {number} {unit}.",
    "The {feeling} of the {trade} grew when {weather} ruined the harvest of {year}.",
    "Years later the {role} {name} recalled the {quality} {landform} with {feeling}.",
    "The account ends in {month} {year}, when {name} {motion_past} back to the {landform}.",
)
_REGISTERS = (_ENCYCLOPEDIC, _TECHNICAL, _CHRONICLE)
_TITLES = ("{place}", "Operating the {device} (series {code})", "The journey of {name}, {year}")


class _Document:
    """One document's cast: a few invented names and places it keeps returning to, as real text does."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.names = [_invented_name(rng) + " " + _invented_name(rng) for _ in range(rng.randint(2, 4))]
        self.places = [_invented_name(rng) for _ in range(rng.randint(2, 4))]

    def fill(self, template: str) -> str:
        rng = self.rng
        values = {
            "name": lambda: rng.choice(self.names),
            "place": lambda: rng.choice(self.places),
            "year": lambda: str(rng.randint(1200, 2050)),
            "day": lambda: str(rng.randint(1, 28)),
            "small": lambda: str(rng.randint(2, 12)),
            "number": lambda: _quantity(rng),
            "code": lambda: _code(rng),
            "mu": lambda: rng.choice(_WORDS["measure_unit"]),
        }
        parts, rest = [], template
        while "{" in rest:
            before, slot_and_after = rest.split("{", 1)
            slot, rest = slot_and_after.split("}", 1)
            parts.append(before)
            parts.append(values[slot]() if slot in values else rng.choice(_WORDS[slot]))
        parts.append(rest)
        return "".join(parts)


def _invented_name(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def _quantity(rng: random.Random) -> str:
    """A number as documents write them: whole, with a decimal, or with thousands separators."""
    form = rng.randrange(3)
    if form == 0:
        return str(rng.randint(3, 999))
    if form == 1:
        return f"{rng.uniform(0.5, 99):.1f}"
    return f"{rng.randint(1000, 999999):,}"


def _code(rng: random.Random) -> str:
    """An identifier such as ``QT-4471`` or ``7Z3-81``, the kind a question asks to repeat."""
    letters = "ABCDEFGHJKLMNPQRSTUVWXYZ"
    shape = rng.randrange(3)
    if shape == 0:
        return f"{rng.choice(letters)}{rng.choice(letters)}-{rng.randint(100, 9999)}"
    if shape == 1:
        return f"{rng.randint(1, 9)}{rng.choice(letters)}{rng.randint(1, 9)}-{rng.randint(10, 99)}"
    return f"{rng.choice(letters)}{rng.randint(10, 99)}/{rng.choice(letters)}{rng.choice(letters)}"


def document(rng: random.Random) -> str:
    """One titled document of 2-4 paragraphs in one register."""
    register = rng.randrange(len(_REGISTERS))
    cast = _Document(rng)
    paragraphs = [" ".join(cast.fill(rng.choice(_REGISTERS[register])) for _ in range(rng.randint(3, 7)))
                  for _ in range(rng.randint(2, 4))]
    return cast.fill(_TITLES[register]) + "\n\n" + "\n\n".join(paragraphs)


def training_text(num_words: int, rng: random.Random) -> str:
    """Documents, separated by blank lines, until they hold at least ``num_words`` words."""
    documents, count = [], 0
    while count < num_words:
        documents.append(document(rng))
        count += len(documents[-1].split())
    return "\n\n".join(documents) + "\n"


def training_sequences(tokenizer, num_sequences: int, seq_len: int, seed: int) -> list[list[int]]:
    """``num_sequences`` token lists of exactly ``seq_len`` tokens (no special tokens), each from its own
    seed (``SEED_SPACE``, ``seed`` and its index), so sequence ``i`` is the same whatever the count asked for."""
    if num_sequences < 0 or seq_len < 1:
        raise ValueError(f"training_sequences needs num_sequences >= 0 and seq_len >= 1; got {num_sequences}, "
                         f"{seq_len}")
    sequences = []
    for index in range(num_sequences):
        words = seq_len
        while True:
            text = training_text(words, random.Random(f"{SEED_SPACE}:{seed}:{index}"))
            ids = tokenizer(text, add_special_tokens=False).input_ids
            if len(ids) >= seq_len:
                break
            words *= 2
        sequences.append(ids[:seq_len])
    return sequences
