"""The query statistics command: each layer's and query head's mean and covariance of the queries before RoPE.

Writes the ``--ea_stats`` file ``--method expected_attention`` reads instead of modelling the
future queries by the prompt's own (kvpress' ExpectedAttentionStatsPress), for any supported
model, without downloads::

    python -m restkv.tools.query_stats --model_path smollm2-135m --out data/query_stats/smollm2-135m.safetensors

The texts are the training corpus of ``restkv.learned.training_text`` (``--num_texts`` of ``--text_length``
tokens), or ``--text_file``; each text's first ``--n_sink`` queries are left out (attention-sink
outliers), the rest of all texts pooled: ``query_mean`` ``[L, H, d]`` and ``query_cov``
``[L, H, d, d]`` (divided by ``n - 1``), as kvpress' collection computes them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from restkv.benchmarks.config_file import add_config_flags, parse_command_line
from restkv.benchmarks.errors import FlagError, command_line
from restkv.benchmarks.flags import check_output_path
from restkv.integrations.transformers.models import model_label
from restkv.integrations.transformers.projections import pre_rope_projections
from restkv.tools.projections import model_and_texts


def collect_query_stats(model, texts: list[list[int]], n_sink: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(query_mean [L, H, d], query_cov [L, H, d, d])`` over ``texts``' queries after their first ``n_sink``."""
    pooled: list[list[torch.Tensor]] = []
    for ids in tqdm(texts, desc="texts", unit="text", file=sys.stderr):
        projections = pre_rope_projections(model, torch.tensor([ids], device=model.device))
        if not pooled:
            pooled = [[] for _ in projections]
        for layer, seen in enumerate(projections):
            pooled[layer].append(seen.query[:, n_sink:])
    queries = torch.stack([torch.cat(layer, dim=1) for layer in pooled])  # [L, H, n, d]
    if queries.shape[2] < 2:
        raise ValueError(f"the texts leave {queries.shape[2]} queries after the first {n_sink} of each: too few")
    mean = queries.mean(dim=2)
    centred = queries - mean[:, :, None]
    return mean, centred.transpose(-1, -2) @ centred / (queries.shape[2] - 1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m restkv.tools.query_stats", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", required=True, help="embedded model name (smollm2-135m), folder or hub id")
    parser.add_argument("--out", default=None, help="output safetensors (default data/query_stats/<model>.safetensors)")
    parser.add_argument("--num_texts", type=int, default=32, help="texts the statistics pool")
    parser.add_argument("--text_length", type=int, default=1000, help="tokens per text")
    parser.add_argument("--text_file", default=None, help="read the texts from this file instead of generating them")
    parser.add_argument("--n_sink", type=int, default=4, help="first queries of each text left out")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated texts")
    add_config_flags(parser)
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args, _ = parse_command_line(build_parser, argv)
    for flag, least in (("num_texts", 1), ("text_length", 2), ("n_sink", 0)):
        if getattr(args, flag) < least:
            raise FlagError(f"--{flag} must be at least {least}; got {getattr(args, flag)}")
    if args.n_sink >= args.text_length - 1:
        raise FlagError(f"--n_sink {args.n_sink} leaves fewer than 2 queries of a {args.text_length}-token text")
    args.out = check_output_path(args.out or f"data/query_stats/{model_label(args.model_path)}.safetensors", "--out")
    return args


@command_line
def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    from safetensors.torch import save_file

    model, texts = model_and_texts(args, args.text_length, "--text_length")
    mean, cov = collect_query_stats(model, texts, args.n_sink)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file({"query_mean": mean.contiguous(), "query_cov": cov.contiguous()}, str(args.out),
              metadata={"made_with": " ".join(["python -m restkv.tools.query_stats", *(argv or sys.argv[1:])])})
    print(args.out)
    return args.out


if __name__ == "__main__":
    main()
