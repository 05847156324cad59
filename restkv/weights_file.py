"""Reading a weights file a training command wrote (IndexMem's, the learned scorer's): every
way it can be wrong is one ``ConfigError`` that names the flag that gave it."""

from __future__ import annotations

from pathlib import Path

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
