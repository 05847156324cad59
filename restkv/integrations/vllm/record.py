"""What compression did to each request, written where ``RESTKV_VLLM_RECORD`` points (a folder), for checks
against the transformers path (``scripts/vllm_bench.py --check``): the kept positions of every layer and KV head
(one file per request, from the workers) and the blocks each request holds once compressed (one line per
request, from the scheduler). Unset, nothing is written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

#: the environment variable naming the folder records go to
RECORD_VARIABLE = "RESTKV_VLLM_RECORD"


def record_folder() -> Path | None:
    folder = os.environ.get(RECORD_VARIABLE)
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    return Path(folder)


def write_kept(folder: Path, req_id: str, prompt_token_ids: list[int], positions: dict[int, torch.Tensor]) -> None:
    """One request's kept positions: ``positions[layer]`` ``[H_kv, K]``."""
    torch.save({"prompt_token_ids": list(prompt_token_ids),
                "positions": {layer: kept.cpu() for layer, kept in positions.items()}},
               folder / f"kept-{os.getpid()}-{req_id}.pt")


def write_blocks(folder: Path, req_id: str, prompt_tokens: int, kept: int, blocks: int) -> None:
    with open(folder / f"blocks-{os.getpid()}.jsonl", "a") as out:
        out.write(json.dumps({"request_id": req_id, "prompt_tokens": prompt_tokens, "kept": kept,
                              "blocks": blocks}) + "\n")


def read_records(folder: str | Path) -> tuple[list[dict], list[dict]]:
    """``(kept, blocks)``: every request's kept positions and blocks written under ``folder``."""
    folder = Path(folder)
    kept = [torch.load(path) for path in sorted(folder.glob("kept-*.pt"))]
    blocks = [json.loads(line) for path in sorted(folder.glob("blocks-*.jsonl"))
              for line in path.read_text().splitlines()]
    return kept, blocks
