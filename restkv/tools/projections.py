"""What the offline-statistics commands share: the model and the texts they read.

The statistics themselves come from each layer's pre-RoPE queries and keys
(``restkv.integrations.transformers.projections``).
"""

from __future__ import annotations

import argparse


def model_and_texts(args: argparse.Namespace, length: int, length_flag: str):
    """``(model, texts)`` of an offline-statistics command: the ``--model_path`` model (sdpa) and
    ``--num_texts`` token lists of ``length`` tokens (the training corpus of ``restkv.learned.training_text``, seeded by
    ``--seed``, or cut from ``--text_file``); a bad path or file, or a model restkv does not serve, is a
    one-line error (a rotation restkv cannot undo is one too, at the first text: ``undoable_rotary``)."""
    from restkv.benchmarks.errors import FlagError
    from restkv.integrations.transformers.models import (check_model_path, check_supported, load_model, load_tokenizer,
                                                         model_path_errors)
    from restkv.tools.train_scorer import training_texts

    check_model_path(args.model_path)
    with model_path_errors(args.model_path):
        model = load_model(args.model_path, attn_implementation="sdpa")
        tokenizer = load_tokenizer(args.model_path)
    check_supported(model, args.model_path)
    try:
        texts = training_texts(tokenizer, argparse.Namespace(text_file=args.text_file, seq_len=length,
                                                             num_sequences=args.num_texts, held_out=0, seed=args.seed))
    except ValueError as error:
        raise FlagError(str(error).replace("--seq_len", length_flag)) from None
    return model, texts
