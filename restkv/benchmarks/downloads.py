"""``python -m restkv.data NAME``: the benchmark data in the layout the runners read.

* ``longbench`` and ``infinitebench``: the official files, downloaded from the benchmark's Hugging Face
  dataset repository (``restkv.benchmarks.sources``) into ``--data_dir/<name>.jsonl`` (the runner's
  default folder unless given). The Hub's own progress bars show the download; a file already in the
  Hub's cache is not downloaded again, also offline. Where the Hub cannot be reached (``HF_HUB_OFFLINE=1``
  without a cached copy, or a network error) one line names the files and where to put them, and the
  command exits with status 2; nothing is half-written (each file is written beside its place, then renamed).
* ``ruler``: generated, not downloaded: the flags go to ``restkv.benchmarks.ruler_data``.
* ``needle``: nothing to fetch; says which haystack the needle test will read.

The files are copied byte for byte: LongBench's repository loads through a script that ``datasets`` 4
and later refuse, and InfiniteBench's tasks hold answers of mixed types that a table would coerce.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import zipfile
from pathlib import Path
from typing import Callable, Sequence

from tqdm import tqdm

from restkv.benchmarks import infinitebench, longbench, ruler_data
from restkv.benchmarks.benchmark import Benchmark
from restkv.benchmarks.haystack import ESSAY_DIR, SYNTHETIC_SOURCE, load_essays
from restkv.benchmarks.sources import HUB_SOURCES, HubSource

#: exit status when the Hub cannot be reached or a name is wrong (argparse's for a usage error)
UNAVAILABLE = 2
HUB_BENCHMARKS: dict[str, Benchmark] = {"longbench": longbench.BENCHMARK, "infinitebench": infinitebench.BENCHMARK}
#: ``download(repo_id, filename) -> local path`` of a file of a Hub dataset repository
Download = Callable[[str, str], Path]


class DataUnavailable(Exception):
    """The Hub could not give a file; the message names the files expected and where they go."""


def hub_download(repo_id: str, filename: str) -> Path:
    """A file of a Hub dataset repository, from the Hub's cache or downloaded into it (with a progress bar)."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(repo_id=repo_id, filename=filename, repo_type="dataset"))
    except (OSError, EntryNotFoundError) as error:  # offline mode, no network, a missing file
        reason = ("HF_HUB_OFFLINE is set and the Hub's cache has no copy" if constants.HF_HUB_OFFLINE
                  else str(error).split(". ")[0].strip() or type(error).__name__)
        raise DataUnavailable(f"cannot get {filename} of {repo_id} from the Hugging Face Hub ({reason})") from None


def fetch(source: HubSource, names: Sequence[str], data_dir: str | Path,
          download: Download = hub_download) -> list[Path]:
    """``<data_dir>/<name>.jsonl`` for every name, copied from the source's files; the paths written."""
    folder = Path(data_dir)
    members = {name: source.member(name) for name in names}
    with contextlib.ExitStack() as stack:
        try:
            if source.archive is not None:
                bundle = stack.enter_context(zipfile.ZipFile(download(source.repo_id, source.archive)))
                absent = sorted(set(members.values()) - set(bundle.namelist()))
                if absent:
                    raise DataUnavailable(f"{source.archive} of {source.repo_id} holds no {', '.join(absent)}")
                open_member = bundle.open
            else:
                paths = {member: download(source.repo_id, member) for member in members.values()}
                open_member = lambda member: open(paths[member], "rb")  # noqa: E731
        except DataUnavailable as error:
            raise DataUnavailable(f"{error}; put {', '.join(f'{name}.jsonl' for name in names)} from "
                                  f"{source.origin()} into {folder}/") from None
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        for name, member in tqdm(members.items(), desc=f"writing {folder}", unit="file"):
            target = folder / f"{name}.jsonl"
            partial = target.with_name(target.name + ".partial")
            with open_member(member) as data, open(partial, "wb") as out:
                shutil.copyfileobj(data, out)
            partial.replace(target)
            written.append(target)
    return written


def needle_haystack_note() -> str:
    """What the needle test reads: the essays in ``data/PaulGrahamEssays`` if there are any, else synthetic prose."""
    source = load_essays(ESSAY_DIR, min_words=0).source
    if source == SYNTHETIC_SOURCE:
        return (f"needle: nothing to download; without essays in {ESSAY_DIR}/ (*.txt files or RULER's "
                "PaulGrahamEssays.json) the haystack is the project's synthetic prose, whose scores are not "
                "comparable with published ones on Paul Graham's essays (not redistributable: put your own copy "
                f"there, or pass --haystack_dir)")
    return f"needle: the haystack is {source} (found); nothing to download"


RULER_EXAMPLE = "python -m restkv.data ruler --tokenizer MODEL --lengths 4096 --tasks synthetic --out data/RULER"


def hub_command(name: str, argv: Sequence[str]) -> list[Path]:
    """The download of one Hub benchmark, ``argv`` its flags (``--datasets``, ``--data_dir``)."""
    benchmark, source = HUB_BENCHMARKS[name], HUB_SOURCES[name]
    parser = argparse.ArgumentParser(prog=f"python -m restkv.data {name}",
                                     description=f"Download {name}'s files from {source.origin()}.")
    parser.add_argument("--datasets", nargs="+", default=list(benchmark.default_datasets), metavar="NAME",
                        help=f"the files to fetch (default: the runner's default set; known: "
                        f"{', '.join(benchmark.datasets)})")
    parser.add_argument("--data_dir", default=benchmark.default_data_dir,
                        help=f"where the runner reads them (default: {benchmark.default_data_dir})")
    args = parser.parse_args(argv)
    unknown = [name for name in args.datasets if name not in benchmark.datasets]
    if unknown:
        parser.error(f"--datasets: unknown {name} dataset(s) {', '.join(unknown)}")
    return fetch(source, args.datasets, args.data_dir)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = (*HUB_BENCHMARKS, "ruler", "needle")
    if not argv or argv[0] not in names:
        given = f"unknown NAME {argv[0]!r}; " if argv and not argv[0].startswith("-") else ""
        print(f"usage: python -m restkv.data NAME [flags]: {given}NAME is one of {', '.join(names)} "
              "(python -m restkv.data NAME --help lists its flags)", file=sys.stderr)
        sys.exit(UNAVAILABLE)
    name, flags = argv[0], argv[1:]
    if name == "needle":
        print(needle_haystack_note())
    elif name == "ruler":
        if not flags:
            print(f"RULER's data are generated, not downloaded: {RULER_EXAMPLE} (the flags of "
                  "python -m restkv.benchmarks.ruler_data; --help lists them)", file=sys.stderr)
            sys.exit(UNAVAILABLE)
        ruler_data.main(flags)
    else:
        try:
            written = hub_command(name, flags)
        except DataUnavailable as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(UNAVAILABLE)
        print(f"wrote {len(written)} file(s) into {written[0].parent}" if written else "nothing to write")
