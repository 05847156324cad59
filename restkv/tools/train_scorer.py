"""Fit ``--method learned_zip``'s scorer to KVzip's reconstruction scores (``restkv.learned.scorer``).

    python -m restkv.train_scorer --model_path smollm2-135m --target kvzip --output learned_zip.pt

The training sequences are the project's training corpus (``restkv.learned.training_text``:
encyclopedic, technical and chronicle prose with codes, quantities, names and dates woven in,
from word lists and structures no benchmark uses), or cut from ``--text_file``; each follows the
chat template's opening when the tokenizer has one, as the runners' prompts do. Each is prefilled
under ``--method kvzip`` (reconstruction observation, the model repeating the text); every layer's
KVzip scores of the text's tokens (not the sinks, not the template) and their features (pre-RoPE
key and value per KV head) go into one ridge regression per layer and KV head on the scores'
logarithm, solved once at the end.

The fit is then judged on text it never saw: ``--held_out`` sequences of each ``--held_out_types``
type (``restkv.benchmarks.heldout_text``: code, records, dialogue, news), on which the command
reports how much of KVzip's model-wide top ``--check_ratio`` the fitted scorer keeps, and the share
of their n-grams found in the training text (``restkv.benchmarks.overlap``; also for the project's
benchmark texts). The report goes into the weights' ``training`` dict (``held_out``,
``benchmark_overlap``); without one (``--held_out 0``, no type) the command writes nothing.
``--baseline_weights`` reports another weights file's recall on the same held-out passes.

Writes ``--output``, what ``--learned_zip_weights`` loads. ``--head_scores_output`` also writes, from
the same training passes, KVzip's head-level importance (its reference's ``--save_head_score``: each
KV head's largest score over the text, one entry per sequence, given to each query head of the
group) as a head score file that ``--head_scores`` reads: per-head budgets from reconstruction, fixed
offline, costing nothing at inference.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
from tqdm import tqdm

from restkv.benchmarks.flags import check_output_path
from restkv.benchmarks.heldout_text import HELD_OUT_TYPES, held_out_sequences
from restkv.benchmarks.overlap import benchmark_texts, token_overlap, word_overlap
from restkv.files.head_scores import head_key, save_head_scores
from restkv.integrations.transformers.deferred import listening_to_scores
from restkv.integrations.transformers.generation import prefill
from restkv.integrations.transformers.models import check_model_path, load_frozen
from restkv.integrations.transformers.patching import replace_for_model, shape_of
from restkv.integrations.transformers.reconstruction_prompt import set_reconstruction_prompt, template_opening
from restkv.learned.scorer import LeastSquares, ScorerWeights, features, load_weights, missing_held_out, save
from restkv.learned.training_text import training_sequences
from restkv.policies.kvzip import SINK_SCORE

TARGETS = ("kvzip",)
#: the smallest score a log-target reads (KVzip's are attention weights; some are 0 in float32)
SCORE_FLOOR = 1e-8
#: what the weights' ``training["text"]`` says when the corpus was the project's own (``restkv.learned.training_text``):
#: the module's name when the shipped weights were made, before it moved below the library's integrations
CORPUS_NAME = "restkv.tools.training_text"


def add_held_out_flags(parser: argparse.ArgumentParser) -> None:
    """The held-out check every learned scorer's trainer runs (weights are written only with its report)."""
    parser.add_argument("--held_out", type=int, default=2,
                        help="held-out sequences of each --held_out_types type the fit is checked on (at least 1)")
    parser.add_argument("--held_out_types", nargs="*", default=list(HELD_OUT_TYPES), choices=HELD_OUT_TYPES,
                        metavar="TYPE", help=f"held-out text types (default: all: {' '.join(HELD_OUT_TYPES)})")


def check_trainer_args(args: argparse.Namespace, written: str, counts: tuple[str, ...]) -> None:
    """What every trainer checks before its model loads (``ValueError`` naming the flag): the model, the output
    file, the held-out report its ``written`` file needs, and its ``counts`` flags at least 1."""
    check_model_path(args.model_path)
    check_output_path(args.output, "--output")
    if args.held_out < 1 or not args.held_out_types:
        raise ValueError(f"--held_out {args.held_out} --held_out_types {' '.join(args.held_out_types) or '(none)'}: "
                         f"{written} are written only with a held-out report (at least 1 sequence of at least 1 type)")
    for flag in counts:
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be at least 1; got {getattr(args, flag)}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1; got {args.threads}")


def loaded_for_training(args: argparse.Namespace, check: Callable[[argparse.Namespace], None]):
    """``(model, tokenizer)`` frozen for a trainer, after ``check(args)``: bad input (a flag, a model that does not
    load) is one ``error:`` line; ``--threads`` set."""
    try:
        check(args)
        model, tokenizer = load_frozen(args.model_path)
    except ValueError as error:  # a flag, a --model_path (ModelPathError)
        raise SystemExit(f"error: {error}") from None
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return model, tokenizer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default="smollm2-135m")
    parser.add_argument("--target", choices=TARGETS, default="kvzip", help="the scores the scorer learns")
    parser.add_argument("--output", default="learned_zip.pt", help="weights file (what --learned_zip_weights loads)")
    parser.add_argument("--text_file", default=None,
                        help=f"plain-text training data (default: the training corpus, {CORPUS_NAME})")
    parser.add_argument("--num_sequences", type=int, default=12, help="training sequences")
    parser.add_argument("--seq_len", type=int, default=1024, help="tokens of text per sequence (held-out ones too)")
    add_held_out_flags(parser)
    parser.add_argument("--baseline_weights", default=None,
                        help="also report these weights' held-out recall, on the same held-out passes")
    parser.add_argument("--ridge", type=float, default=1e-3,
                        help="ridge penalty, relative to the mean feature energy (0: least squares)")
    parser.add_argument("--reconstruction_chunk", type=int, default=2048, help="KVzip's chunk while scoring")
    parser.add_argument("--check_ratio", type=float, default=0.1, help="budget share of the held-out check")
    parser.add_argument("--head_scores_output", default=None,
                        help="also write KVzip's head-level importance of the same passes as a head score file "
                             "(what --head_scores reads: HeadKV's allocation, query-agnostic and free at inference)")
    parser.add_argument("--seed", type=int, default=0, help="which training and held-out sequences")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Every check that needs no model, before the model loads (``ValueError`` naming the flag)."""
    check_trainer_args(args, "weights", ("num_sequences", "reconstruction_chunk"))
    for flag in ("text_file", "baseline_weights"):
        if getattr(args, flag) is not None and not Path(getattr(args, flag)).is_file():
            raise ValueError(f"--{flag} {getattr(args, flag)!r}: no such file")
    if args.baseline_weights is not None:
        load_weights(args.baseline_weights, "--baseline_weights")
    if args.head_scores_output is not None:
        check_output_path(args.head_scores_output, "--head_scores_output")
    if args.seq_len < 64:
        raise ValueError(f"--seq_len must be at least 64 (a sequence must leave KVzip something to evict); "
                         f"got {args.seq_len}")
    if not args.ridge >= 0:
        raise ValueError(f"--ridge must be >= 0; got {args.ridge}")
    if not 0 < args.check_ratio < 1:
        raise ValueError(f"--check_ratio must lie in (0, 1); got {args.check_ratio}")


def training_texts(tokenizer, args: argparse.Namespace) -> list[list[int]]:
    """``--num_sequences`` token lists of ``--seq_len`` tokens each: cut from ``--text_file``, or the training
    corpus (``restkv.learned.training_text``) under ``--seed``."""
    if args.text_file is None:
        return training_sequences(tokenizer, args.num_sequences, args.seq_len, args.seed)
    ids = tokenizer(Path(args.text_file).read_text(encoding="utf-8"), add_special_tokens=False).input_ids
    if len(ids) < args.seq_len:
        raise ValueError(f"--text_file {args.text_file!r} holds {len(ids)} tokens, fewer than --seq_len")
    count = min(args.num_sequences, len(ids) // args.seq_len)
    return [ids[i * args.seq_len : (i + 1) * args.seq_len] for i in range(count)]


class Collected:
    """One prefill's regression inputs, layer by layer: features ``[H_kv, N, p]``, log-scores and
    the mask of the tokens that count (scored text, not sinks or template)."""

    def __init__(self) -> None:
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def __call__(self, ctx, scores: torch.Tensor) -> None:
        mask = ctx.candidates[0][None].expand_as(scores[0]) & (scores[0] < SINK_SCORE)
        target = scores[0].float().clamp(min=SCORE_FLOOR).log()
        self.layers[ctx.layer_idx] = (features(ctx.pre_rope_key, ctx.value)[0], target, mask)


def head_importance(collected: Collected, num_heads: int) -> dict[str, float]:
    """``{"layer-query head": KVzip's largest score of the KV head over the sequence's text}``."""
    importance = {}
    for index, (_, target, mask) in sorted(collected.layers.items()):
        peaks = target.masked_fill(~mask, float("-inf")).amax(dim=-1).exp()  # [H_kv]
        groups = num_heads // peaks.numel()
        for head in range(num_heads):
            importance[head_key(index, head)] = float(f"{float(peaks[head // groups]):.4g}")
    return importance


def held_out_recall(weights: ScorerWeights, collected: Collected, ratio: float) -> float:
    """Share of KVzip's model-wide top ``ratio`` of the text's (layer, head, token) entries that the
    fitted scorer's top ``ratio`` holds."""
    truth, predicted = [], []
    for index, (x, target, mask) in sorted(collected.layers.items()):
        truth.append(target[mask])
        predicted.append(weights.predict_from(index, x)[mask])
    truth, predicted = torch.cat(truth), torch.cat(predicted)
    top = max(1, int(ratio * truth.numel()))
    kept = set(predicted.topk(top).indices.tolist())
    return len(kept & set(truth.topk(top).indices.tolist())) / top


def kvzip_passes(model, opening: list[int], texts: list[list[int]], description: str) -> Iterator[Collected]:
    """Each text's KVzip scores and features, prefilled after the template's ``opening`` as a context span."""
    num_layers = shape_of(model).num_layers
    for text in tqdm(texts, desc=description):
        collected = Collected()
        ids = torch.tensor(opening + text)[None]
        with listening_to_scores(collected), torch.no_grad():
            prefill(model, ids, context_span=(len(opening), ids.shape[1]))
        unscored = sorted(set(range(num_layers)) - set(collected.layers))
        if unscored:
            raise SystemExit(f"error: KVzip scores no token of layers {unscored} (sliding-window layers it does not "
                             "compress): a learned scorer needs every layer's scores")
        yield collected


def overlap_report(tokenizer, training: list[list[int]], evaluation: list[list[int]]) -> dict[str, float]:
    """The shares of ``evaluation``'s token 8-grams and word 5-grams found in ``training``
    (``restkv.benchmarks.overlap``)."""
    decode = lambda sequences: [tokenizer.decode(ids) for ids in sequences]  # noqa: E731
    return {"token_overlap": token_overlap(evaluation, training),
            "word_overlap": word_overlap(decode(evaluation), decode(training))}


def write_weights(path: str, weights: ScorerWeights, held_out_types: list[str]) -> None:
    """Save ``weights``, or refuse (one ``error:`` line, nothing written) when their held-out report is missing."""
    missing = missing_held_out(weights, held_out_types)
    if missing:
        raise SystemExit(f"error: no held-out report for {', '.join(missing)}: weights not written to {path}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save(path, weights)


def patch_for_kvzip_scores(model, tokenizer, seq_len: int, reconstruction_chunk: int) -> list[int]:
    """Patch ``model`` to run KVzip over a sequence of ``seq_len`` text tokens after the chat template's opening
    (the prompts' own format), and return that opening's ids (the BOS token without a template). The budget only
    decides what KVzip would keep; its scores do not depend on it (the template is kept)."""
    set_reconstruction_prompt(model, tokenizer)
    opening = tokenizer(template_opening(tokenizer), add_special_tokens=False).input_ids
    if not opening and tokenizer.bos_token_id is not None:
        opening = [tokenizer.bos_token_id]
    replace_for_model(model, method="kvzip", max_capacity_prompts=len(opening) + max(1, seq_len // 10),
                      reconstruction_chunk=reconstruction_chunk)
    return opening


def main(argv: list[str] | None = None) -> ScorerWeights:
    """The command line; bad input (flags, a model that does not load) is one ``error:`` line."""
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        model, tokenizer = load_frozen(args.model_path)
        texts = training_texts(tokenizer, args)
    except ValueError as error:  # a flag, a --model_path (ModelPathError), too short a --text_file
        raise SystemExit(f"error: {error}") from None
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    opening = patch_for_kvzip_scores(model, tokenizer, args.seq_len, args.reconstruction_chunk)
    model_shape = shape_of(model)
    shape = (model_shape.num_layers, model_shape.num_kv_heads, model_shape.head_dim)
    fits, heads = LeastSquares(*shape), {}
    started = time.time()
    for collected in kvzip_passes(model, opening, texts, f"KVzip scores ({args.model_path})"):
        for name, value in head_importance(collected, model_shape.num_heads).items():
            heads.setdefault(name, []).append(value)
        for index, (x, target, mask) in collected.layers.items():
            fits.add(index, x, target, mask)
    weight, error = fits.solve(args.ridge)
    training = {"model_path": args.model_path, "target": args.target, "text": args.text_file or CORPUS_NAME,
                "sequences": len(texts), "seq_len": args.seq_len, "tokens": int(fits.tokens.sum()),
                "ridge": args.ridge, "reconstruction_chunk": args.reconstruction_chunk, "seed": args.seed,
                "mean_squared_log_error": float(error.mean()), "check_ratio": args.check_ratio}
    weights = ScorerWeights(weight, args.target, training)
    baseline = load_weights(args.baseline_weights, "--baseline_weights") if args.baseline_weights else None
    training["held_out"], baseline_recall = {}, {}
    for text_type in args.held_out_types:
        sequences = held_out_sequences(tokenizer, text_type, args.held_out, args.seq_len, args.seed)
        recalls, baseline_recalls = [], []
        for collected in kvzip_passes(model, opening, sequences, f"held-out {text_type}"):
            recalls.append(held_out_recall(weights, collected, args.check_ratio))
            if baseline is not None:
                baseline_recalls.append(held_out_recall(baseline, collected, args.check_ratio))
        training["held_out"][text_type] = {"sequences": len(sequences), "recall": sum(recalls) / len(recalls),
                                           **overlap_report(tokenizer, texts, sequences)}
        if baseline is not None:
            baseline_recall[text_type] = sum(baseline_recalls) / len(baseline_recalls)
    if baseline is not None:
        training["baseline"] = {"weights": args.baseline_weights, "recall": baseline_recall}
    training["benchmark_overlap"] = {
        name: overlap_report(tokenizer, texts, [tokenizer(text, add_special_tokens=False).input_ids])
        for name, text in benchmark_texts(tokenizer).items()}
    write_weights(args.output, weights, args.held_out_types)
    if args.head_scores_output is not None:
        save_head_scores(args.head_scores_output, heads)
        print(f"wrote {args.head_scores_output}: KVzip's head-level importance over {len(texts)} sequences")
    print(f"wrote {args.output}: {shape[0]} layers x {shape[1]} KV heads, fitted on {training['tokens']} (layer, head, "
          f"token) scores in {time.time() - started:.0f} s; mean squared log error "
          f"{training['mean_squared_log_error']:.3f}")
    print(held_out_table(training))
    return weights


def held_out_table(training: dict) -> str:
    """The held-out report as a Markdown table: per type, the recall (and the baseline's) and the overlaps."""
    baseline = training.get("baseline", {}).get("recall", {})
    columns = ["type", f"recall of KVzip's top {training['check_ratio']:.0%}",
               *(["baseline recall"] if baseline else []), "token 8-gram overlap", "word 5-gram overlap"]
    rows = [[name, f"{report['recall']:.3f}", *([f"{baseline[name]:.3f}"] if baseline else []),
             f"{report['token_overlap']:.2%}", f"{report['word_overlap']:.2%}"]
            for name, report in training["held_out"].items()]
    worst = max(training["benchmark_overlap"].items(), key=lambda item: item[1]["token_overlap"])
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns),
             *("| " + " | ".join(row) + " |" for row in rows)]
    return "\n".join(lines) + (f"\nlargest overlap with a benchmark text: {worst[0]} "
                               f"(token {worst[1]['token_overlap']:.2%}, word {worst[1]['word_overlap']:.2%})")


if __name__ == "__main__":
    main()
