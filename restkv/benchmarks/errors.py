"""The errors of the benchmark layer: bad data, a results folder holding another run, a cache
that did not compress."""

from __future__ import annotations


class DataError(ValueError):
    """Malformed benchmark input; the message names the file, the line and the field."""


class CompressionNotApplied(RuntimeError):
    """The prompt exceeded the budget but some layer kept everything: the patch is not active."""


class RunMismatch(RuntimeError):
    """The results folder already holds a run with other settings."""
