"""The DuoAttention pattern command: which KV heads read far back, from the model's own mean query and key.

Writes the ``--duo_pattern`` file ``--method duo_attention`` reads, for any supported model,
without downloads::

    python -m restkv.tools.duo_pattern --model_path smollm2-135m --out data/duo_patterns/smollm2-135m.json

DuoAttention trains a gate per KV head; this is the training-free score kvpress computes when it
has no trained pattern (``DuoAttentionPress(on_the_fly_scoring=True)``): over ``--num_texts``
texts (the training corpus of ``restkv.learned.training_text``, or ``--text_file``), each layer's mean query and
mean key before RoPE are repeated over ``--span`` positions and rotated there (with the layer's own
RoPE and attention scaling; kvpress turns every layer with the model's rotary embedding and scales
by ``1 / sqrt(d)``: the same where the layers share one RoPE and use the usual scaling); a head's
score is the area under the cumulative attention curve of the last query over those keys, averaged
over its query group and the texts. A head whose RoPE makes the
repeated query look far back scores high (retrieval); one that reads only its neighbours scores
low (streaming). The file records ``--sink_size`` and ``--recent_size`` (kvpress' 128 and 256 for
this score) for the run: ``--n_sink`` and ``--max_capacity_prompts`` of the sum.

Where this differs from kvpress: the mean query and key are taken after the attention's q/k norms
(Gemma 3, Qwen 3, OLMo 2...), as the attention computes them. kvpress' scoring means to apply the
norms of Gemma 3 and Qwen 3 but tests the decoder layer, not its attention, against those classes,
so it never does; ``--no-qk_norm`` reproduces that (a pattern of another ranking on such models).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from restkv.benchmarks.config_file import add_config_flags, parse_command_line
from restkv.benchmarks.errors import FlagError, command_line
from restkv.benchmarks.flags import check_output_path
from restkv.integrations.transformers.models import model_label
from restkv.scoring.rope import rotate
from restkv.tools.projections import model_and_texts, pre_rope_projections


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
    for ids in tqdm(texts, desc="texts", unit="text", file=sys.stderr):
        projections = pre_rope_projections(model, torch.tensor([ids], device=model.device), qk_norm=qk_norm)
        scores = torch.stack([head_scores_of(seen.query.mean(dim=1), seen.key.mean(dim=1),
                                             tuple(table[:, :span] for table in seen.rotary), layer.self_attn.scaling)
                              for seen, layer in zip(projections, layers)])
        total = scores if total is None else total + scores
    return total / len(texts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m restkv.tools.duo_pattern", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", required=True, help="embedded model name (smollm2-135m), folder or hub id")
    parser.add_argument("--out", default=None, help="output JSON (default data/duo_patterns/<model>.json)")
    parser.add_argument("--num_texts", type=int, default=20, help="texts the means are taken over")
    parser.add_argument("--span", type=int, default=500, help="positions the mean query and key are repeated over "
                                                              "(each text has at least this many tokens)")
    parser.add_argument("--text_file", default=None, help="read the texts from this file instead of generating them")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated texts")
    parser.add_argument("--sink_size", type=int, default=128, help="recorded: the sinks a streaming head keeps")
    parser.add_argument("--recent_size", type=int, default=256, help="recorded: the newest tokens a streaming head keeps")
    parser.add_argument("--qk_norm", action=argparse.BooleanOptionalAction, default=True,
                        help="take the mean query and key after the attention's q/k norms (q_norm, k_norm), as the "
                             "attention computes them; --no-qk_norm: before them, as kvpress' on-the-fly scoring does "
                             "(it means to apply Gemma 3's and Qwen 3's norms but never does)")
    add_config_flags(parser)
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args, _ = parse_command_line(build_parser, argv)
    for flag in ("num_texts", "span", "sink_size", "recent_size"):
        if getattr(args, flag) < (0 if flag == "sink_size" else 1):
            raise FlagError(f"--{flag} must be at least {0 if flag == 'sink_size' else 1}; got {getattr(args, flag)}")
    if args.span < 2:
        raise FlagError(f"--span must be at least 2 positions; got {args.span}")
    args.out = check_output_path(args.out or f"data/duo_patterns/{model_label(args.model_path)}.json", "--out")
    return args


@command_line
def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    model, texts = model_and_texts(args, args.span, "--span")
    scores = compute_pattern(model, texts, args.span, args.qk_norm)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"sink_size": args.sink_size, "recent_size": args.recent_size,
                                    "head_scores": [[round(float(v), 6) for v in row] for row in scores],
                                    "made_with": " ".join(["python -m restkv.tools.duo_pattern",
                                                           *(argv or sys.argv[1:])])})
                        + "\n")
    print(args.out)
    return args.out


if __name__ == "__main__":
    main()
