"""Reading a file a flag names (a weights file a training command wrote, a statistics or
pattern file): every way it can be wrong is one ``ConfigError`` that names the flag, and a
file is parsed once while it is unchanged."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Callable, TypeVar

import torch

from restkv.options import ConfigError


def read_payload(path: str | Path, flag: str, command: str, formats: tuple[str, ...], kind: str) -> dict:
    """The dict ``torch.save`` wrote at ``path`` whose ``format`` is one of ``formats``; ``command``
    trains such a file, ``kind`` names it in the message."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{flag} {str(path)!r}: no such file (train one with python -m {command})")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many kinds for a file that is not a checkpoint
        raise ConfigError(f"{flag} {str(path)!r} is not a readable weights file ({type(error).__name__})") from None
    if not isinstance(payload, dict) or payload.get("format") not in formats:
        raise ConfigError(f"{flag} {str(path)!r} is not {kind} weights file (format {formats[0]})")
    return payload


Parsed = TypeVar("Parsed")


def read_file_once(path: str, flag: str, parse: Callable[[str], Parsed]) -> Parsed:
    """``parse(path)`` of the file ``flag`` names, parsed again only once the file changes (a
    module-level ``parse``: it is part of the cache key); a path that is no file names the flag."""
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path!r} is not a file")
    return _parsed(parse, os.path.abspath(path), os.path.getmtime(path))


@functools.lru_cache(maxsize=16)
def _parsed(parse: Callable[[str], Parsed], path: str, modified: float) -> Parsed:
    return parse(path)


def load_safetensors(path: str, flag: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; one that is not one names ``flag``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError) as error:
        raise ConfigError(f"{flag} {path!r} cannot be read as safetensors: {error}") from None
