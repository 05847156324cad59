"""Train ``--method kvzap``'s surrogates on KVzip's reconstruction scores (``restkv.learned.kvzap``).

    python -m restkv.tools.train_kvzap --model_path smollm2-135m --kind linear --output kvzap.safetensors

Each training sequence (``restkv.learned.training_text``: generated prose that shares nothing with
what the scorers are judged on) follows the chat template's opening, as the runners' prompts do,
and is prefilled under ``--method kvzip`` with the context span set: the model repeats the text,
and every layer's KVzip score of each text token (not the sinks, not the template) is read per KV
head (``listening_to_scores``, the log of the score as ``train_scorer`` takes it) beside the
token's hidden state at the attention's input (a forward pre-hook on each attention: its first
call in a prefill is the context's forward, the later ones KVzip's repetitions). One surrogate per
layer is then fitted, ``--kind linear`` (ridge regression) or ``--kind mlp`` (a two-layer GELU MLP
of ``--hidden`` units trained with AdamW), and written in kvpress' ``KVzapModel`` layout: what
``--kvzap_weights`` loads.

The check is on text it never saw: ``--held_out`` sequences of each ``--held_out_types`` type
(``restkv.benchmarks.heldout_text``: code, records, dialogue, news), on which the command reports,
for each ``--check_ratio``, the share of KVzip's model-wide top entries (every (layer, KV head,
token)) that the surrogates' top holds, beside that of learned_zip's linear map of pre-RoPE keys
and values fitted by ``train_scorer``'s regression to the same sequences (the two compared on one
footing), and the share of each type's n-grams found in the training text. No file is written
without that report; it goes into the file's metadata with how the surrogates were made
(``restkv.learned.kvzap.training_record``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

from restkv.benchmarks.heldout_text import held_out_sequences
from restkv.integrations.transformers.patching import shape_of
from restkv.learned.kvzap import Surrogate, fit_linear, fit_mlp, predict, save_surrogates
from restkv.learned.scorer import LeastSquares, ScorerWeights
from restkv.learned.training_text import training_sequences
from restkv.tools.train_scorer import (CORPUS_NAME, Collected, add_held_out_flags, check_trainer_args, held_out_recall,
                                       kvzip_passes, loaded_for_training, overlap_report, patch_for_kvzip_scores)

KINDS = ("linear", "mlp")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default="smollm2-135m")
    parser.add_argument("--kind", choices=KINDS, default="linear", help="the surrogate: one linear map per layer "
                        "(on SmolLM2-135M as good as the MLP held out: docs/methods/reconstruction.md), or a "
                        "two-layer GELU MLP")
    parser.add_argument("--output", default="kvzap.safetensors", help="surrogates file (what --kvzap_weights loads)")
    parser.add_argument("--num_sequences", type=int, default=24, help="training sequences")
    parser.add_argument("--seq_len", type=int, default=1024, help="tokens of text per sequence")
    add_held_out_flags(parser)
    parser.add_argument("--check_ratio", type=float, nargs="+", default=[0.1, 0.2],
                        help="budget shares of the held-out check")
    parser.add_argument("--ridge", type=float, default=1e-3,
                        help="ridge penalty of the linear fits, relative to the mean feature energy (0: least squares)")
    parser.add_argument("--hidden", type=int, default=64,
                        help="--kind mlp: hidden units per layer (KVzap's reference: 512 for 4096-wide models, an "
                             "eighth of the width; 64 is about an eighth of SmolLM2-135M's 576)")
    parser.add_argument("--epochs", type=int, default=15, help="--kind mlp: passes over the training tokens")
    parser.add_argument("--lr", type=float, default=5e-3, help="--kind mlp: AdamW's learning rate (cosine schedule)")
    parser.add_argument("--batch_size", type=int, default=512, help="--kind mlp: tokens per step")
    parser.add_argument("--reconstruction_chunk", type=int, default=2048, help="KVzip's chunk while scoring")
    parser.add_argument("--seed", type=int, default=0, help="the training text's and the MLP's seed")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Every check that needs no model, before the model loads (``ValueError`` naming the flag)."""
    check_trainer_args(args, "surrogates", ("num_sequences", "hidden", "epochs", "batch_size", "reconstruction_chunk"))
    if args.seq_len < 64:
        raise ValueError(f"--seq_len must be at least 64 (a sequence must leave KVzip something to evict); "
                         f"got {args.seq_len}")
    if not all(0 < ratio < 1 for ratio in args.check_ratio):
        raise ValueError(f"--check_ratio must lie in (0, 1); got {args.check_ratio}")
    if not args.ridge >= 0:
        raise ValueError(f"--ridge must be >= 0; got {args.ridge}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be > 0; got {args.lr}")


class AttentionInputs:
    """Within the block, each layer's hidden state at its attention's input (``[N, D]`` float32) in the
    last prefill (``take``): a forward pre-hook on every attention keeps its first call after ``take``,
    the context's forward (the later ones are KVzip's repetitions)."""

    def __init__(self, model) -> None:
        self.layers = model.get_decoder().layers
        self.hidden: dict[int, torch.Tensor] = {}

    def __enter__(self) -> "AttentionInputs":
        self.hooks = [layer.self_attn.register_forward_pre_hook(self.record, with_kwargs=True)
                      for layer in self.layers]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self.hooks:
            hook.remove()

    def record(self, module, args, kwargs) -> None:
        self.hidden.setdefault(module.layer_idx, kwargs.get("hidden_states", args[0] if args else None)[0].float())

    def take(self) -> dict[int, torch.Tensor]:
        hidden, self.hidden = self.hidden, {}
        return hidden


class SurrogatePredictions:
    """Surrogates read as ``held_out_recall`` reads a learned scorer: ``[H_kv, N]`` from ``[N, D]``."""

    def __init__(self, surrogates: list[Surrogate]) -> None:
        self.surrogates = surrogates

    def predict_from(self, layer_idx: int, hidden: torch.Tensor) -> torch.Tensor:
        return predict(self.surrogates[layer_idx], hidden).transpose(-1, -2)


def with_hidden(collected: Collected, hidden: dict[int, torch.Tensor]) -> Collected:
    """``collected`` with each layer's hidden states in place of its key and value features."""
    view = Collected()
    view.layers = {index: (hidden[index], target, mask) for index, (_, target, mask) in collected.layers.items()}
    return view


def fit(args: argparse.Namespace, hidden: list[torch.Tensor], targets: list[torch.Tensor]) -> Surrogate:
    """One layer's surrogate from its training tokens' hidden states ``[T, D]`` and log-scores ``[T, H_kv]``."""
    if args.kind == "linear":
        return fit_linear(hidden, targets, args.ridge)
    generator = torch.Generator().manual_seed(args.seed)
    return fit_mlp(hidden, targets, args.hidden, args.epochs, args.lr, args.batch_size, generator)


def main(argv: list[str] | None = None) -> list[Surrogate]:
    """The command line; bad input (flags, a model that does not load) is one ``error:`` line."""
    args = build_parser().parse_args(argv)
    model, tokenizer = loaded_for_training(args, check_args)
    opening = patch_for_kvzip_scores(model, tokenizer, args.seq_len, args.reconstruction_chunk)
    shape = shape_of(model)
    started = time.time()
    key_value_fit = LeastSquares(shape.num_layers, shape.num_kv_heads, shape.head_dim)
    inputs: dict[int, list[torch.Tensor]] = {}
    targets: dict[int, list[torch.Tensor]] = {}
    texts = training_sequences(tokenizer, args.num_sequences, args.seq_len, args.seed)
    with AttentionInputs(model) as attention_inputs:
        for collected in kvzip_passes(model, opening, texts, f"KVzip scores ({args.model_path})"):
            hidden = attention_inputs.take()
            for index, (x, target, mask) in collected.layers.items():
                key_value_fit.add(index, x, target, mask)
                tokens = mask.all(dim=0)  # the sinks and the template are every head's
                inputs.setdefault(index, []).append(hidden[index][tokens])
                targets.setdefault(index, []).append(target[:, tokens].T)
        surrogates = [fit(args, torch.cat(inputs.pop(index)), torch.cat(targets.pop(index)))
                      for index in tqdm(range(shape.num_layers), desc=f"fitting {args.kind} surrogates")]
        key_value = ScorerWeights(key_value_fit.solve(args.ridge)[0], "kvzip")
        held_out = {}
        for text_type in args.held_out_types:
            sequences = held_out_sequences(tokenizer, text_type, args.held_out, args.seq_len, args.seed)
            recalls = {"kvzap": {ratio: [] for ratio in args.check_ratio},
                       "learned_zip": {ratio: [] for ratio in args.check_ratio}}
            for collected in kvzip_passes(model, opening, sequences, f"held-out {text_type}"):
                surrogate_view = with_hidden(collected, attention_inputs.take())
                for ratio in args.check_ratio:
                    recalls["kvzap"][ratio].append(held_out_recall(SurrogatePredictions(surrogates), surrogate_view,
                                                                   ratio))
                    recalls["learned_zip"][ratio].append(held_out_recall(key_value, collected, ratio))
            held_out[text_type] = {"sequences": len(sequences), **overlap_report(tokenizer, texts, sequences),
                                   **{f"{scorer}_recall": {f"{ratio:g}": sum(values) / len(values)
                                                           for ratio, values in by_ratio.items()}
                                      for scorer, by_ratio in recalls.items()}}
    training = {"model_path": args.model_path, "kind": args.kind, "target": "kvzip", "text": CORPUS_NAME,
                "sequences": len(texts), "seq_len": args.seq_len, "seed": args.seed, "ridge": args.ridge,
                "reconstruction_chunk": args.reconstruction_chunk,
                **({"hidden": args.hidden, "epochs": args.epochs, "lr": args.lr, "batch_size": args.batch_size}
                   if args.kind == "mlp" else {}),
                "held_out": held_out}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    save_surrogates(args.output, surrogates, training)
    print(f"wrote {args.output}: {args.kind} surrogates of {shape.num_layers} layers x {shape.num_kv_heads} KV heads "
          f"from {len(texts)} sequences in {time.time() - started:.0f} s")
    print(held_out_table(held_out))
    return surrogates


def held_out_table(held_out: dict) -> str:
    """The held-out report as a Markdown table: per type, kvzap's recall of KVzip's top entries beside
    learned_zip's map fitted to the same sequences, and the type's overlap with the training text."""
    ratios = list(next(iter(held_out.values()))["kvzap_recall"])
    columns = ["type", *(f"{scorer} top {float(ratio):.0%}" for ratio in ratios for scorer in ("kvzap", "learned_zip")),
               "token 8-gram overlap", "word 5-gram overlap"]
    rows = [[name, *(f"{report[f'{scorer}_recall'][ratio]:.3f}" for ratio in ratios
                     for scorer in ("kvzap", "learned_zip")),
             f"{report['token_overlap']:.2%}", f"{report['word_overlap']:.2%}"] for name, report in held_out.items()]
    return "\n".join(["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns),
                      *("| " + " | ".join(row) + " |" for row in rows)])


if __name__ == "__main__":
    main()
