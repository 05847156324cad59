"""DuoAttention's head scores computed from the model: offline (``python -m restkv.tools.duo_pattern``) or on
the fly (``--duo_on_the_fly``), the same computation.

DuoAttention trains a gate per KV head; this is the training-free score kvpress computes when it has no
trained pattern (``DuoAttentionPress(on_the_fly_scoring=True)``): over a set of texts, each layer's mean
query and mean key before RoPE are repeated over ``span`` positions and rotated there (with the layer's
own RoPE and attention scaling; kvpress turns every layer with the model's rotary embedding and scales by
``1 / sqrt(d)``: the same where the layers share one RoPE and use the usual scaling); a head's score is the
area under the cumulative attention curve of the last query over those keys, averaged over its query
group and the texts. A head whose RoPE makes the repeated query look far back scores high (retrieval); one
that reads only its neighbours scores low (streaming).

On the fly, the texts are the project's own generated corpus (``restkv.learned.training_text``: prose from
word lists and structures of its own, nothing downloaded; kvpress samples 50 BookSum chapters from the Hub)
encoded by the model's tokenizer, loaded from ``model.config.name_or_path`` as kvpress loads it: the pattern
command's defaults (20 texts of 500 tokens, seed 0), so the on-the-fly scores are the scores the command
writes for that model. They are computed once per model, when a config is given with its model
(``restkv.compression``, ``configure``, ``replace_for_model``), and written as a pattern file in restkv's
cache folder (``RESTKV_CACHE_DIR``, default ``~/.cache/restkv``), named by the model's name and a digest of its
first and last attention layers' weights: the config the model then runs names that file as its
``--duo_pattern``, and a later run of the same model reads it instead of scoring again.

Where this differs from kvpress: the mean query and key are taken after the attention's q/k norms (Gemma 3,
Qwen 3, OLMo 2...), as the attention computes them; kvpress means to apply Gemma 3's and Qwen 3's but tests
the decoder layer against those classes, so never does (the pattern command's ``--no-qk_norm`` reproduces
that; on the fly the scores are always read after the norms). kvpress averages over whole chapters; here
each text is the span's tokens.
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from restkv.allocations.duo import DuoAllocation
from restkv.config import CompressionConfig, ConfigError
from restkv.integrations.transformers.models import cache_dir, load_tokenizer
from restkv.integrations.transformers.projections import pre_rope_projections
from restkv.learned.training_text import training_sequences
from restkv.scoring.rope import rotate

#: the texts the scores are taken over by default, on the fly and offline: their count, length and seed
NUM_TEXTS, SPAN, SEED = 20, 500, 0
#: the sinks and newest tokens a streaming head keeps with these scores (kvpress' for them), recorded in a file
SINK_SIZE, RECENT_SIZE = 128, 256


def head_scores_of(query: torch.Tensor, key: torch.Tensor, rotary: tuple, scaling: float) -> torch.Tensor:
    """``[H_kv]`` the area under the last repeated query's cumulative attention over the repeated keys."""
    span = rotary[0].shape[1]
    queries = rotate(query[None, :, None].expand(-1, -1, span, -1), *rotary)[0, :, -1]  # [H, d]
    keys = rotate(key[None, :, None].expand(-1, -1, span, -1), *rotary)[0]  # [H_kv, span, d]
    groups = queries.shape[0] // keys.shape[0]
    weights = torch.einsum("hd,hnd->hn", queries, keys.repeat_interleave(groups, dim=0)) * scaling
    area = weights.softmax(dim=-1).cumsum(dim=-1).mean(dim=-1)
    return area.view(keys.shape[0], groups).mean(dim=-1)


def compute_pattern(model, texts: list[list[int]], span: int, qk_norm: bool = True) -> torch.Tensor:
    """``[L, H_kv]`` head scores averaged over ``texts`` (``qk_norm``: the means after the family's q/k norms)."""
    layers = model.get_decoder().layers
    total = None
    for ids in tqdm(texts, desc="DuoAttention head scores", unit="text", file=sys.stderr):
        projections = pre_rope_projections(model, torch.tensor([ids], device=model.device), qk_norm=qk_norm)
        scores = torch.stack([head_scores_of(seen.query.mean(dim=1), seen.key.mean(dim=1),
                                             tuple(table[:, :span] for table in seen.rotary), layer.self_attn.scaling)
                              for seen, layer in zip(projections, layers)])
        total = scores if total is None else total + scores
    return total / len(texts)


def write_pattern(path: Path, scores: torch.Tensor, sink_size: int, recent_size: int, made_with: str) -> Path:
    """``scores`` ``[L, H_kv]`` as the pattern file ``--duo_pattern`` reads, with the sizes they are meant for."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"sink_size": sink_size, "recent_size": recent_size,
                                "head_scores": [[round(float(v), 6) for v in row] for row in scores],
                                "made_with": made_with}) + "\n")
    return path


def with_model_scores(model, config: CompressionConfig, modules: list[torch.nn.Module]) -> CompressionConfig:
    """``config`` as ``model`` runs it: where it scores DuoAttention's heads on the fly, with the pattern file of
    this model's scores as its ``--duo_pattern`` (computed and written the first time; see the module docstring)."""
    allocation = config.allocator
    if not isinstance(allocation, DuoAllocation) or not allocation.duo_on_the_fly:
        return config
    path = _pattern_path(model, modules)
    if not path.exists():
        write_pattern(path, _scores_on_the_fly(model), SINK_SIZE, RECENT_SIZE,
                      f"restkv --duo_on_the_fly for {model.config.name_or_path} ({NUM_TEXTS} texts of {SPAN} tokens of "
                      f"restkv.learned.training_text, seed {SEED}; python -m restkv.tools.duo_pattern's defaults)")
    return config.replace(duo_pattern=str(path), duo_on_the_fly=False)


def _pattern_path(model, modules: list[torch.nn.Module]) -> Path:
    """Where this model's on-the-fly scores are kept: its name and a digest of its first and last attention layers."""
    digest = hashlib.sha256(f"{model.config.name_or_path}|{NUM_TEXTS}|{SPAN}|{SEED}".encode())
    for module in (modules[0], modules[-1]):
        for name, tensor in sorted(module.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().float().cpu().numpy().tobytes())
    label = Path(str(model.config.name_or_path).rstrip("/")).name or "model"
    return cache_dir() / "duo_patterns" / f"{label}-{digest.hexdigest()[:16]}.json"


def _scores_on_the_fly(model) -> torch.Tensor:
    """``[L, H_kv]`` the model's head scores on the project's texts, encoded by its own tokenizer."""
    name = model.config.name_or_path
    try:
        tokenizer = load_tokenizer(name)
    except (OSError, ValueError) as error:
        why = (str(error).splitlines() or [type(error).__name__])[0]
        raise ConfigError(f"--duo_on_the_fly scores the heads on text the model's tokenizer encodes; none loads from "
                          f"its name_or_path {name!r} ({why}): give --duo_pattern FILE (python -m "
                          "restkv.tools.duo_pattern --model_path MODEL writes one)") from None
    texts = training_sequences(tokenizer, NUM_TEXTS, SPAN, SEED)
    with warnings.catch_warnings():  # the scoring forwards run without a cache, on purpose
        warnings.filterwarnings("ignore", message="restkv: this forward has no cache")
        try:
            return compute_pattern(model, texts, SPAN)
        except ConfigError as error:
            raise ConfigError(f"--duo_on_the_fly: {error}") from None
