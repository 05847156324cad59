"""The DuoAttention pattern command: which KV heads read far back, from the model's own mean query and key.

Writes the ``--duo_pattern`` file ``--method duo_attention`` reads, for any supported model,
without downloads::

    python -m restkv.tools.duo_pattern --model_path smollm2-135m --out data/duo_patterns/smollm2-135m.json

The score is the training-free one kvpress computes when it has no trained pattern
(``restkv.integrations.transformers.duo_scores`` says how), over ``--num_texts`` texts of ``--span``
tokens (the training corpus of ``restkv.learned.training_text``, or ``--text_file``). With its defaults
the file holds the scores ``--duo_on_the_fly`` computes for the model when it is configured. The file
records ``--sink_size`` and ``--recent_size`` (kvpress' 128 and 256 for this score) for the run:
``--n_sink`` and ``--max_capacity_prompts`` of the sum.

Where this differs from kvpress: the mean query and key are taken after the attention's q/k norms
(Gemma 3, Qwen 3, OLMo 2...), as the attention computes them. kvpress' scoring means to apply the
norms of Gemma 3 and Qwen 3 but tests the decoder layer, not its attention, against those classes,
so it never does; ``--no-qk_norm`` reproduces that (a pattern of another ranking on such models).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from restkv.benchmarks.config_file import add_config_flags, parse_command_line
from restkv.benchmarks.errors import FlagError, command_line
from restkv.benchmarks.flags import check_output_path
from restkv.integrations.transformers.duo_scores import (NUM_TEXTS, RECENT_SIZE, SEED, SINK_SIZE, SPAN, compute_pattern,
                                                         write_pattern)
from restkv.integrations.transformers.models import model_label
from restkv.tools.projections import model_and_texts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m restkv.tools.duo_pattern", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", required=True, help="embedded model name (smollm2-135m), folder or hub id")
    parser.add_argument("--out", default=None, help="output JSON (default data/duo_patterns/<model>.json)")
    parser.add_argument("--num_texts", type=int, default=NUM_TEXTS, help="texts the means are taken over")
    parser.add_argument("--span", type=int, default=SPAN, help="positions the mean query and key are repeated over "
                                                               "(each text has at least this many tokens)")
    parser.add_argument("--text_file", default=None, help="read the texts from this file instead of generating them")
    parser.add_argument("--seed", type=int, default=SEED, help="seed of the generated texts")
    parser.add_argument("--sink_size", type=int, default=SINK_SIZE, help="recorded: the sinks a streaming head keeps")
    parser.add_argument("--recent_size", type=int, default=RECENT_SIZE,
                        help="recorded: the newest tokens a streaming head keeps")
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
    write_pattern(args.out, scores, args.sink_size, args.recent_size,
                  " ".join(["python -m restkv.tools.duo_pattern", *(argv or sys.argv[1:])]))
    print(args.out)
    return args.out


if __name__ == "__main__":
    main()
