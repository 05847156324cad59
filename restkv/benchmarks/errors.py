"""The errors a benchmark command reports in one line, and the one place that reports them.

Bad flags, bad data, a results folder holding another run, a folder another process is
writing, a cache that did not compress: the user fixes a flag, a file or the setup, so every
runner and evaluator prints ``error: <message>`` on stderr and exits with status 1
(``command_line``) instead of a traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable, TypeVar

from restkv.config import ConfigError
from restkv.integrations.transformers.models import ModelPathError
from restkv.integrations.transformers.seams import UnsupportedModel

Entry = TypeVar("Entry", bound=Callable)


class BenchmarkError(Exception):
    """A problem of a command's input or of its results folder, not of the code."""


class FlagError(BenchmarkError, ValueError):
    """A command-line value that cannot work; the message names the flag."""


class DataError(BenchmarkError, ValueError):
    """Malformed benchmark input; the message names the file, the line and the field."""


class RunMismatch(BenchmarkError, RuntimeError):
    """The results folder already holds a run with other settings."""


class RunFolderBusy(BenchmarkError, RuntimeError):
    """Another process is writing the same dataset and shard of the results folder."""


class CompressionNotApplied(BenchmarkError, RuntimeError):
    """The prompt exceeded the budget but some layer kept everything: the patch is not active."""


class CompressionMismatch(CompressionNotApplied):
    """The cache was compressed with other settings than the ones the run records."""


#: What ``command_line`` reports in one line: the errors above, a bad compression option, a
#: model path that loads nothing, a model restkv does not serve, and a missing file or folder named
#: on the command line.
REPORTED = (BenchmarkError, ConfigError, ModelPathError, UnsupportedModel, FileNotFoundError)


def command_line(entry: Entry) -> Entry:
    """``entry`` (a runner's or evaluator's main function) printing ``error: ...`` on stderr and
    exiting with status 1 on a ``REPORTED`` error."""

    @functools.wraps(entry)
    def reporting(*args, **kwargs):
        try:
            return entry(*args, **kwargs)
        except REPORTED as error:
            sys.exit(f"error: {error}")

    return reporting  # type: ignore[return-value]
