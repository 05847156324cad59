"""Fit ``--method learned_zip``'s scorer to KVzip's reconstruction scores (``restkv.learned.scorer``).

    python -m restkv.tools.train_scorer --model_path smollm2-135m --target kvzip --output learned_zip.pt

Each training sequence is the library's synthetic prose with facts woven in (a named code, a
number, a date: the kind of detail a later question asks for and a repetition must copy), after
the chat template's opening when the tokenizer has one, as the runners' prompts are. It is
prefilled under ``--method kvzip`` (reconstruction observation, the model repeating the text);
every layer's KVzip scores of the text's tokens (not the sinks, not the template) and their
features (pre-RoPE key and value per KV head) go into one ridge regression per layer and KV
head on the scores' logarithm, solved once at the end. The last ``--held_out`` sequences are
not fitted: on them the command reports how much of KVzip's model-wide top ``--check_ratio``
the fitted scorer keeps.

The text is synthetic unless ``--text_file`` is given (plain text, cut into pieces). Writes
``--output``, what ``--learned_zip_weights`` loads. ``--head_scores_output`` also writes, from the
same passes, KVzip's head-level importance (its reference's ``--save_head_score``: each KV head's
largest score over the text, one entry per sequence, given to each query head of the group) as a
head score file that ``--head_scores`` reads: per-head budgets from reconstruction, fixed
offline, costing nothing at inference.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from restkv.benchmarks.flags import check_output_path
from restkv.benchmarks.text import prose_vocabulary, synthetic_prose
from restkv.files.head_scores import head_key, save_head_scores
from restkv.integrations.transformers.deferred import listening_to_scores
from restkv.integrations.transformers.generation import prefill
from restkv.integrations.transformers.models import check_model_path, load_frozen
from restkv.integrations.transformers.patching import replace_for_model, shape_of
from restkv.integrations.transformers.reconstruction_prompt import set_reconstruction_prompt, template_opening
from restkv.learned.scorer import LeastSquares, ScorerWeights, features, save
from restkv.policies.kvzip import SINK_SCORE

TARGETS = ("kvzip",)
#: the smallest score a log-target reads (KVzip's are attention weights; some are 0 in float32)
SCORE_FLOOR = 1e-8


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default="smollm2-135m")
    parser.add_argument("--target", choices=TARGETS, default="kvzip", help="the scores the scorer learns")
    parser.add_argument("--output", default="learned_zip.pt", help="weights file (what --learned_zip_weights loads)")
    parser.add_argument("--text_file", default=None, help="plain-text training data (default: synthetic prose)")
    parser.add_argument("--num_sequences", type=int, default=12, help="training sequences, held-out ones included")
    parser.add_argument("--seq_len", type=int, default=1024, help="tokens of text per sequence")
    parser.add_argument("--held_out", type=int, default=2, help="last sequences kept out of the fit, to check it")
    parser.add_argument("--ridge", type=float, default=1e-3,
                        help="ridge penalty, relative to the mean feature energy (0: least squares)")
    parser.add_argument("--reconstruction_chunk", type=int, default=2048, help="KVzip's chunk while scoring")
    parser.add_argument("--check_ratio", type=float, default=0.1, help="budget share of the held-out check")
    parser.add_argument("--head_scores_output", default=None,
                        help="also write KVzip's head-level importance of the same passes as a head score file "
                             "(what --head_scores reads: HeadKV's allocation, query-agnostic and free at inference)")
    parser.add_argument("--seed", type=int, default=0, help="where the facts go and what they say")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Every check that needs no model, before the model loads (``ValueError`` naming the flag)."""
    check_model_path(args.model_path)
    if args.text_file is not None and not Path(args.text_file).is_file():
        raise ValueError(f"--text_file {args.text_file!r}: no such file")
    for flag in ("output", "head_scores_output"):
        if getattr(args, flag) is not None:
            check_output_path(getattr(args, flag), f"--{flag}")
    for flag in ("num_sequences", "reconstruction_chunk"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be at least 1; got {getattr(args, flag)}")
    if args.seq_len < 64:
        raise ValueError(f"--seq_len must be at least 64 (a sequence must leave KVzip something to evict); "
                         f"got {args.seq_len}")
    if not 0 <= args.held_out < args.num_sequences:
        raise ValueError(f"--held_out must lie in [0, --num_sequences {args.num_sequences}); got {args.held_out}")
    if not args.ridge >= 0:
        raise ValueError(f"--ridge must be >= 0; got {args.ridge}")
    if not 0 < args.check_ratio < 1:
        raise ValueError(f"--check_ratio must lie in (0, 1); got {args.check_ratio}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1; got {args.threads}")


def prose_with_facts(num_words: int, rng: random.Random) -> str:
    """Synthetic prose of about ``num_words`` words with a fact every 40-120 words."""
    vocab = prose_vocabulary()
    words = synthetic_prose(num_words + rng.randrange(4 * num_words)).split(" ")
    start = rng.randrange(max(len(words) - num_words, 1))
    words = words[start : start + num_words]
    kinds = (lambda: f"The access code for the {rng.choice(vocab['N'])} is {rng.randrange(10**5, 10**7)}.",
             lambda: f"Note that {rng.choice(vocab['N'])} number {rng.randrange(100, 999)} belongs to "
                     f"{rng.choice(vocab['A'])} {rng.choice(vocab['N'])}.",
             lambda: f"On day {rng.randrange(1, 29)} of month {rng.randrange(1, 13)} the {rng.choice(vocab['N'])} "
                     f"was moved to room {rng.randrange(10, 99)}-{rng.choice('ABCDEFGH')}.")
    position = rng.randrange(40, 120)
    while position < len(words):
        words.insert(position, rng.choice(kinds)())
        position += rng.randrange(40, 120)
    return " ".join(words)


def training_texts(tokenizer, args: argparse.Namespace) -> list[list[int]]:
    """``--num_sequences`` token lists of ``--seq_len`` tokens each."""
    if args.text_file is not None:
        ids = tokenizer(Path(args.text_file).read_text(encoding="utf-8"), add_special_tokens=False).input_ids
        if len(ids) < args.seq_len:
            raise ValueError(f"--text_file {args.text_file!r} holds {len(ids)} tokens, fewer than --seq_len")
        count = min(args.num_sequences, len(ids) // args.seq_len)
        if count <= args.held_out:
            raise ValueError(f"--text_file {args.text_file!r} gives {count} sequences of --seq_len {args.seq_len}, "
                             f"none left to fit beside --held_out {args.held_out}")
        return [ids[i * args.seq_len : (i + 1) * args.seq_len] for i in range(count)]
    rng = random.Random(args.seed)
    texts = []
    for _ in range(args.num_sequences):
        words = args.seq_len
        while len(ids := tokenizer(prose_with_facts(words, rng), add_special_tokens=False).input_ids) < args.seq_len:
            words *= 2
        texts.append(ids[: args.seq_len])
    return texts


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
    set_reconstruction_prompt(model, tokenizer)
    opening = tokenizer(template_opening(tokenizer), add_special_tokens=False).input_ids
    if not opening and tokenizer.bos_token_id is not None:
        opening = [tokenizer.bos_token_id]
    model_shape = shape_of(model)
    shape = (model_shape.num_layers, model_shape.num_kv_heads, model_shape.head_dim)
    fits, checks, heads = LeastSquares(*shape), [], {}
    # The budget only decides what KVzip would keep; its scores do not depend on it (the template is kept).
    replace_for_model(model, method="kvzip", max_capacity_prompts=len(opening) + max(1, args.seq_len // 10),
                      reconstruction_chunk=args.reconstruction_chunk)
    fitted = len(texts) - args.held_out
    started = time.time()
    for number, text in enumerate(tqdm(texts, desc=f"KVzip scores ({args.model_path})")):
        collected = Collected()
        ids = torch.tensor(opening + text)[None]
        with listening_to_scores(collected), torch.no_grad():
            prefill(model, ids, context_span=(len(opening), ids.shape[1]))
        unscored = sorted(set(range(model_shape.num_layers)) - set(collected.layers))
        if unscored:
            raise SystemExit(f"error: KVzip scores no token of layers {unscored} (sliding-window layers it does not "
                             "compress): learned_zip needs every layer's scores")
        for name, value in head_importance(collected, model_shape.num_heads).items():
            heads.setdefault(name, []).append(value)
        if number < fitted:
            for index, (x, target, mask) in collected.layers.items():
                fits.add(index, x, target, mask)
        else:
            checks.append(collected)
    weight, error = fits.solve(args.ridge)
    training = {"model_path": args.model_path, "target": args.target, "text": args.text_file or "synthetic prose+facts",
                "sequences": fitted, "seq_len": args.seq_len, "tokens": int(fits.tokens.sum()),
                "ridge": args.ridge, "reconstruction_chunk": args.reconstruction_chunk, "seed": args.seed,
                "mean_squared_log_error": float(error.mean())}
    weights = ScorerWeights(weight, args.target, training)
    if checks:
        recalls = [held_out_recall(weights, collected, args.check_ratio) for collected in checks]
        training["held_out_recall"] = sum(recalls) / len(recalls)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    save(args.output, weights)
    if args.head_scores_output is not None:
        save_head_scores(args.head_scores_output, heads)
        print(f"wrote {args.head_scores_output}: KVzip's head-level importance over {len(texts)} sequences")
    recall = f"; held-out recall of KVzip's top {args.check_ratio:.0%}: {training['held_out_recall']:.3f}" if checks else ""
    print(f"wrote {args.output}: {shape[0]} layers x {shape[1]} KV heads, fitted on {training['tokens']} (layer, head, "
          f"token) scores in {time.time() - started:.0f} s; mean squared log error {training['mean_squared_log_error']:.3f}"
          f"{recall}")
    return weights


if __name__ == "__main__":
    main()
