"""Where each benchmark's data come from, and the one-line error for a data file that is not there.

The runners read files in a fixed layout under ``--data_dir``; the files come from the benchmark's
own release on the Hugging Face Hub (LongBench, InfiniteBench), from the project's generator (RULER)
or are optional (the needle test's essays). ``python -m restkv.data NAME`` fetches or makes them;
a runner that misses one says where it comes from and that command, instead of only its path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from restkv.benchmarks.errors import DataError


@dataclass(frozen=True)
class HubSource:
    """A benchmark's official files in a Hub dataset repository: ``<name>.jsonl`` inside ``archive``
    (a zip at the repository's root) under ``folder``, or at the root when there is no archive."""

    benchmark: str  # the runner's name, and the ``python -m restkv.data`` argument
    repo_id: str
    archive: str | None = None
    folder: str = ""

    def member(self, name: str) -> str:
        """The path of ``name``'s file inside the archive (or the repository)."""
        return f"{self.folder}{name}.jsonl"

    def origin(self) -> str:
        """Where the files are, in words (``data/<name>.jsonl of data.zip in the Hugging Face dataset ...``)."""
        where = f"{self.member('<name>')} of {self.archive} in" if self.archive else "the root of"
        return f"{where} the Hugging Face dataset {self.repo_id} (https://huggingface.co/datasets/{self.repo_id})"

    def missing(self, path: str | Path) -> DataError:
        """The error for a data file the runner did not find: its path, where it comes from, the command."""
        path = Path(path)
        return DataError(f"{path}: no such data file; the {self.benchmark} files <data_dir>/<name>.jsonl come from "
                         f"{self.origin()}: python -m restkv.data {self.benchmark} --datasets {path.stem} "
                         f"--data_dir {path.parent} fetches it")


#: LongBench v1 and LongBench-E (``<name>_e``): the official ``data.zip`` of THUDM's dataset repository,
#: which its README points to (the repository's loading script is refused by ``datasets`` 4 and later).
LONGBENCH = HubSource("longbench", "THUDM/LongBench", archive="data.zip", folder="data/")
#: InfiniteBench: one ``<task>.jsonl`` per task at the root of OpenBMB's dataset repository.
INFINITEBENCH = HubSource("infinitebench", "xinrongzhang2022/InfiniteBench")

HUB_SOURCES = {source.benchmark: source for source in (LONGBENCH, INFINITEBENCH)}
