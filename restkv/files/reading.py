"""Reading a file a flag names (a weights file a training command wrote, a statistics or
pattern file): every way it can be wrong is one ``ConfigError`` that names the flag and the file,
and a file is parsed once while it is unchanged.

Every file option reads through ``read_file_once`` and is declared ``names_file`` (so a run's
records fingerprint the file's content). Its content is checked when the config is built
(``finite_floats``: numbers, not NaN); its shape against the model when the config is given one
(``check_shape``, from the part's ``check_model``)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch

from restkv.config.options import ConfigError


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
    """``parse(path)`` of the file ``flag`` names, parsed again only once the file changes (its
    modification time or size; a module-level ``parse``: it is part of the cache key). A path that
    is no file, and whatever ``parse`` raises for a file that is not what the flag takes, is a
    ``ConfigError`` naming the flag and the file (a ``ValueError``'s message is the parser's word on
    the content, without the path)."""
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path!r} is not a file")
    status = os.stat(path)
    try:
        return _parsed(parse, os.path.abspath(path), status.st_mtime_ns, status.st_size)
    except ConfigError:
        raise
    except ValueError as error:  # the parser's word on the content
        raise ConfigError(f"{flag} {path!r}: {error}") from None
    except Exception as error:  # a reader raises many kinds for a file of another format
        raise ConfigError(f"{flag} {path!r} cannot be read ({type(error).__name__}: {error})") from None


@functools.lru_cache(maxsize=16)
def _parsed(parse: Callable[[str], Parsed], path: str, modified: int, size: int) -> Parsed:
    return parse(path)


def finite_floats(flag: str, path: str, tensors: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``tensors`` (by name) as float32, or a ``ConfigError`` naming the flag, the file and the first
    entry that is not a tensor of finite floating-point numbers."""
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            kind = f"a {tensor.dtype} tensor" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ConfigError(f"{flag} {path!r}: {name} must be a tensor of floating-point numbers; got {kind}")
        if not bool(torch.isfinite(tensor).all()):
            raise ConfigError(f"{flag} {path!r}: {name} holds NaN or infinite values")
    return {name: tensor.float() for name, tensor in tensors.items()}


def check_shape(flag: str, path: str, name: str, shape: Sequence[int], needed: Sequence[int | None]) -> None:
    """Refuse (naming the flag and the file) the entry ``name`` of shape ``shape`` where the model
    needs ``needed`` (None: any size): what a part's ``check_model`` asks of a file."""
    if len(shape) != len(needed) or any(want is not None and size != want for size, want in zip(shape, needed)):
        wanted = ", ".join("*" if want is None else str(want) for want in needed)
        raise ConfigError(f"{flag} {path!r}: {name} is {list(shape)}; the model needs [{wanted}] (a file made for "
                          "another model?)")


def load_safetensors(path: str, flag: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; one that is not one names ``flag``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except (SafetensorError, OSError) as error:
        raise ConfigError(f"{flag} {path!r} cannot be read as safetensors: {error}") from None
