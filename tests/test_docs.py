"""docs/methods holds true: every registered part has a section, every option a part declares is in its section's
table (or the shared table) with the default the code declares, no table names an option its parts lack, the index
lists every page; and nothing in the repository cites the team's notes that are not part of it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from restkv.config.composition import RunOptions
from restkv.config.options import KIND_FLAGS, KINDS, lookup, names, option_specs

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "methods"
INDEX = DOCS / "README.md"
#: ``--method snapkv`` or ``--residual`` in a section heading: the parts the section documents
HEADING_PART = re.compile(r"`--(\w+)(?: (\w+))?`")
ROW = re.compile(r"^\| `--(\w+)` \| ([^|]*) \|")
FLAG_KINDS = {flag: kind for kind, flag in KIND_FLAGS.items()}


def shown(value) -> str:
    """A default as the tables write it."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return " ".join(shown(item) for item in value) or "(empty)"
    return str(value)


def heading_parts(heading: str) -> list[tuple[str, str]]:
    """The (kind, name) of every part a section heading names."""
    parts = []
    for flag, name in HEADING_PART.findall(heading):
        if flag in FLAG_KINDS and name:
            parts.append((FLAG_KINDS[flag], name))
        elif not name and flag in names("switch"):
            parts.append(("switch", flag))
    return parts


def sections() -> dict[tuple[str, ...], list]:
    """Per page and section heading: the parts it documents and its table rows ``{flag: default}``."""
    found = {}
    for page in sorted(DOCS.glob("*.md")):
        heading, rows = None, {}
        for line in [*page.read_text().splitlines(), "## end"]:
            if line.startswith("#"):
                if heading is not None and heading_parts(heading):
                    found[(page.name, heading)] = [heading_parts(heading), rows]
                heading, rows = line, {}
            elif (row := ROW.match(line)) is not None:
                rows[row.group(1)] = row.group(2).strip()
    return found


def shared_rows() -> dict[str, str]:
    """The index's tables of shared and run options."""
    return {row.group(1): row.group(2).strip() for line in INDEX.read_text().splitlines()
            if (row := ROW.match(line)) is not None}


def test_every_registered_part_has_one_section():
    documented = [part for parts, _ in sections().values() for part in parts]
    for kind in KINDS:
        for name in names(kind):
            assert documented.count((kind, name)) == 1, f"{kind} {name!r}: {documented.count((kind, name))} sections"


def test_every_option_is_documented_with_the_codes_default():
    shared = shared_rows()
    for (page, heading), (parts, rows) in sections().items():
        for kind, name in parts:
            for spec in option_specs(lookup(kind, name)).values():
                where = rows if spec.name in rows else shared
                assert spec.name in where, f"{page} {heading}: --{spec.name} of {kind} {name} is not documented"
                assert where[spec.name] == shown(spec.default), (
                    f"{page} {heading}: --{spec.name} shows {where[spec.name]!r}; {kind} {name}'s default is "
                    f"{shown(spec.default)!r}")


def test_no_table_names_an_option_its_parts_lack():
    for (page, heading), (parts, rows) in sections().items():
        declared = {flag for kind, name in parts for flag in option_specs(lookup(kind, name))}
        assert set(rows) <= declared, f"{page} {heading}: {sorted(set(rows) - declared)} belong to no part there"


def test_the_run_options_are_documented_with_their_defaults():
    shared = shared_rows()
    for spec in option_specs(RunOptions).values():
        assert shared.get(spec.name) == shown(spec.default), f"README.md: --{spec.name}"


def test_the_index_links_every_page():
    linked = set(re.findall(r"\]\((\w+\.md)\)", INDEX.read_text()))
    assert linked == {page.name for page in DOCS.glob("*.md")} - {"README.md"}


def test_nothing_cites_the_teams_notes_outside_the_repository():
    """The notes the project was built from are not shipped; what the code relies on is in docs/."""
    notes = [f"{note}.md" for note in ("ALGORITHMS", "NEWER_METHODS", "DESIGN", "BENCHMARKS", "USERS", "STYLE")]
    patterns = [argument for pattern in [*notes, "../shared"] for argument in ("-e", pattern)]
    cited = subprocess.run(["git", "grep", "--untracked", "-l", "-I", "-F", *patterns, "--", ".",
                            ":(exclude)tests/test_docs.py"], cwd=ROOT, capture_output=True, text=True)
    assert cited.stdout == "", f"cite notes outside the repository: {cited.stdout.split()}"
