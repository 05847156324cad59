"""Read the golden fixtures produced by the original ReST-KV release's policies (``data/fixtures/golden``)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import torch

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "golden"


def load_case(name: str) -> dict:
    """Arrays of one case as float32 tensors, plus its ``policy`` and ``options``."""
    data = np.load(GOLDEN_DIR / f"{name}.npz", allow_pickle=True)
    case = {key: torch.from_numpy(data[key]) for key in data.files if data[key].dtype.kind == "f"}
    case["policy"] = str(data["policy"])
    case["options"] = ast.literal_eval(str(data["options"]))
    return case


def reference_kept_sets(case: dict) -> list[set[int]]:
    """Per head, the prompt positions the reference kept (it stores them in score order, so
    each kept key row is matched to its exact row in the input)."""
    key, kept = case["key"][0], case["key_out"][0]
    sets = []
    for head in range(key.shape[0]):
        equal = (kept[head][:, None, :] == key[head][None, :, :]).all(dim=-1)
        assert bool((equal.sum(dim=-1) == 1).all()), "a kept row matches no unique input row"
        sets.append(set(equal.float().argmax(dim=-1).tolist()))
    return sets


def kept_sets(indices: torch.Tensor) -> list[set[int]]:
    """Per head of row 0, the positions ``compress_kv`` kept."""
    return [set(i for i in head.tolist() if i >= 0) for head in indices[0]]
