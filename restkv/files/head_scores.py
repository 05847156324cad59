"""HeadKV head-importance score files: the format, its check and its loader.

A score file (the format of HeadKV's released files) is one JSON object on one line whose keys are
``"<layer>-<query head>"`` in layer-major order for every query head of the model, each
holding a list of per-probe scores; a head's importance is the mean of its list.
``python -m restkv.tools.head_scores`` computes one for any supported model.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch


# ---------------------------------------------------------------- the file format
def head_key(layer: int, head: int) -> str:
    return f"{layer}-{head}"


_KEY = re.compile(r"(\d+)-(\d+)")


def read_head_score_file(path: str | Path) -> dict[tuple[int, int], float]:
    """``{(layer, query head): importance}`` (the mean of each head's list) of a score file.

    Raises ``ValueError`` naming the file when it is not one JSON object of
    ``"layer-head": [numbers]`` entries with scores ``>= 0``, not all zero.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            entries = json.load(handle)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"head score file {str(path)!r} cannot be read as JSON: {error}") from None
    if not isinstance(entries, dict) or not entries:
        raise ValueError(f"head score file {str(path)!r} must hold one JSON object of \"layer-head\": [scores]")
    means = {}
    for key, values in entries.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise ValueError(f"head score file {str(path)!r}: key {key!r} is not \"<layer>-<query head>\"")
        if not isinstance(values, list) or not values or not all(_finite_number(v) for v in values):
            raise ValueError(f"head score file {str(path)!r}: {key} must be a non-empty list of numbers")
        means[int(match.group(1)), int(match.group(2))] = sum(values) / len(values)
    if any(mean < 0 for mean in means.values()) or sum(means.values()) <= 0:
        raise ValueError(f"head score file {str(path)!r}: scores must be >= 0 and not all zero")
    return means


def load_head_scores(path: str | Path, num_layers: int, num_heads: int) -> torch.Tensor:
    """``[num_layers, num_heads]`` float64 importance from a score file (``read_head_score_file``).

    Raises ``ValueError`` naming the file when it does not describe exactly this model's
    ``num_layers * num_heads`` query heads, or holds no usable score.
    """
    means = read_head_score_file(path)
    expected = {(layer, head) for layer in range(num_layers) for head in range(num_heads)}
    if set(means) != expected:
        missing, extra = sorted(expected - set(means)), sorted(set(means) - expected)
        raise ValueError(
            f"head score file {str(path)!r} has {len(means)} heads, the model has {num_layers} layers x "
            f"{num_heads} query heads = {len(expected)}; missing {[head_key(*k) for k in missing[:5]]}, "
            f"unexpected {[head_key(*k) for k in extra[:5]]}"
        )
    return torch.tensor([[means[layer, head] for head in range(num_heads)] for layer in range(num_layers)],
                        dtype=torch.float64)


def _finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def save_head_scores(path: str | Path, scores: dict[str, list[float]]) -> None:
    """Write a score file: one JSON object on one line, keys in the given (layer-major) order."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(scores, separators=(", ", ": ")) + "\n", encoding="utf-8")


