"""The HeadKV score command: retrieval-reasoning head scores from offline needle probes.

Computes HeadKV-R2-style scores (HeadKV, arXiv 2410.19258) with needle-in-a-haystack probes
generated offline (a seeded synthetic haystack, a few needles with their question and
answer), over a grid of context lengths and insertion depths, and writes a score file
(``restkv.files.head_scores``) that ``--allocation headkv`` reads::

    python -m restkv.tools.head_scores --model_path smollm2-135m \\
        --out data/heads_score/smollm2-135m_retrieval_reasoning_heads.json

For every probe the model greedily decodes the answer with eager attention; at every step,
for every layer and query head, the current query's top-``n`` attended positions (``n`` =
needle length in tokens) that fall inside the needle add
``10 * weight / (n * answer_tokens)`` to the head's probe score. As in the reference, only
probes answered correctly (LongBench's token F1 > 0.5) contribute unless ``--include_failed``.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from restkv.benchmarks.config_file import add_config_flags, parse_command_line
from restkv.benchmarks.errors import BenchmarkError, FlagError, command_line
from restkv.benchmarks.flags import check_output_path
from restkv.benchmarks.longbench_metrics import qa_f1_score
from restkv.files.head_scores import head_key, save_head_scores
from restkv.integrations.transformers.compat import with_cache


class NoHeadScores(BenchmarkError, RuntimeError):
    """The probes gave no usable score (none counted, or every score zero): nothing is written."""


# ---------------------------------------------------------------- offline probes
@dataclass(frozen=True)
class Needle:
    """A fact hidden in the haystack, the question that needs it, and the expected answer.

    ``answer_prefix`` starts the model's reply, so that the decoded tokens are the answer
    itself (small chat models otherwise restate the question first).
    """

    text: str
    question: str
    answer_prefix: str
    answer: str


NEEDLES = (
    Needle(
        "Nadia hid the spare key to the greenhouse under a blue flowerpot.",
        "Under what did Nadia hide the spare key to the greenhouse?",
        "Nadia hid the spare key under",
        "a blue flowerpot",
    ),
    Needle(
        "The secret number of the Harbor Lighthouse is 4172.",
        "What is the secret number of the Harbor Lighthouse?",
        "The secret number of the Harbor Lighthouse is",
        "4172",
    ),
    Needle(
        "Omar owns the red bicycle, and the red bicycle is kept in the garage behind the bakery.",
        "Where is Omar's bicycle kept?",
        "Omar's bicycle is kept",
        "in the garage behind the bakery",
    ),
    Needle(
        "The best pizza in Lisbon is served at a tiny shop called Forno Azul.",
        "What is the name of the shop that serves the best pizza in Lisbon?",
        "The shop is called",
        "Forno Azul",
    ),
    Needle(
        "Professor Ilse Marten keeps her rare maps in a green cabinet, and the cabinet stands in room 214.",
        "In which room are Professor Marten's rare maps?",
        "Her rare maps are in room",
        "214",
    ),
)

_SUBJECTS = (
    "The old farmer", "A young engineer", "The river guide", "Our neighbour", "The committee",
    "A quiet student", "The orchestra", "The small bakery", "A travelling merchant", "The city council",
)
_VERBS = (
    "discussed", "painted", "repaired", "described", "measured",
    "visited", "ignored", "celebrated", "planned", "collected",
)
_OBJECTS = (
    "the northern bridge", "a wooden fence", "the autumn harvest", "several empty crates", "the morning train",
    "an abandoned warehouse", "the long report", "a field of wheat", "the stone tower", "the evening market",
)
_TAILS = (
    "before the storm arrived.", "after a long lunch.", "with great care.", "for the third time this year.",
    "while the bells rang.", "without saying a word.", "near the edge of town.", "as the sun went down.",
)


def haystack(num_sentences: int, seed: int) -> list[str]:
    """Seeded filler sentences (no downloads): distinct enough that a needle stands out."""
    rng = random.Random(seed)
    return [
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
        for _ in range(num_sentences)
    ]


@dataclass(frozen=True)
class Probe:
    """One tokenised probe: prompt ids and the needle's token span ``[start, end)``."""

    input_ids: torch.Tensor
    needle_start: int
    needle_end: int
    needle: Needle
    context_length: int
    depth: int


def build_probe(tokenizer, needle: Needle, context_length: int, depth: int, seed: int = 0) -> Probe:
    """A prompt of about ``context_length`` tokens with ``needle`` at ``depth`` percent of the
    haystack (at a sentence boundary), asked through the chat template when the tokenizer has one."""
    sentences = haystack(max(8, context_length // 6), seed)
    token_counts = [len(tokenizer(" " + s, add_special_tokens=False)["input_ids"]) for s in sentences]
    budget = context_length - len(tokenizer(needle.text, add_special_tokens=False)["input_ids"])
    kept, used = [], 0
    for sentence, count in zip(sentences, token_counts):
        if used + count > budget:
            break
        kept.append(sentence)
        used += count
    cut = round(len(kept) * depth / 100)
    context = " ".join(kept[:cut] + [needle.text] + kept[cut:])
    question = (
        f"{context}\n\nBased on the content of the text above, answer the question.\n"
        f"Question: {needle.question}\nAnswer:"
    )
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt += needle.answer_prefix
    else:
        prompt = f"{question} {needle.answer_prefix}"
    encoded = tokenizer(prompt, add_special_tokens=True, return_offsets_mapping=True)
    char_start = prompt.index(needle.text)
    char_end = char_start + len(needle.text)
    inside = [i for i, (a, b) in enumerate(encoded["offset_mapping"]) if a < char_end and b > char_start and b > a]
    return Probe(
        torch.tensor([encoded["input_ids"]]), inside[0], inside[-1] + 1, needle, context_length, depth
    )


# ---------------------------------------------------------------- scoring one probe
@torch.no_grad()
def probe_head_scores(model, tokenizer, probe: Probe, max_new_tokens: int = 50) -> tuple[torch.Tensor, list[int]]:
    """``[layers, query heads]`` retrieval-reasoning score of one probe, and the answer's token ids.

    The prompt minus its last token is prefilled; the answer is then decoded greedily one
    token at a time with attention weights (the model must use eager attention), stopping at
    a newline, EOS, or the answer's token count.
    """
    from transformers import DynamicCache

    if model.config._attn_implementation != "eager":
        raise ValueError("head scores need attention weights: load the model with attn_implementation='eager'")
    device = next(model.parameters()).device
    ids = probe.input_ids.to(device)
    answer_tokens = _answer_token_count(tokenizer, probe.needle)
    span = probe.needle_end - probe.needle_start
    eos_ids = _eos_ids(model, tokenizer)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :-1], use_cache=True, logits_to_keep=1, **with_cache(cache))
    token = ids[:, -1:]
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    scores = torch.zeros(layers, heads, dtype=torch.float64)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        out = model(input_ids=token, use_cache=True, output_attentions=True, **with_cache(cache))
        weights = torch.stack([a[0, :, -1, :] for a in out.attentions]).float()  # [layers, heads, keys]
        top_weights, top_positions = weights.topk(min(span, weights.shape[-1]), dim=-1)
        in_needle = (top_positions >= probe.needle_start) & (top_positions < probe.needle_end)
        scores += (10.0 * top_weights * in_needle).sum(dim=-1).double().cpu() / (span * answer_tokens)
        next_id = int(out.logits[0, -1].argmax())
        generated.append(next_id)
        token = torch.tensor([[next_id]], device=device)
        if next_id in eos_ids or "\n" in tokenizer.decode([next_id]) or len(generated) >= answer_tokens:
            break
    return scores, generated


def _answer_token_count(tokenizer, needle: Needle) -> int:
    """Tokens of the answer as it continues the prefix (a leading space may be its own token)."""
    prefix = tokenizer(needle.answer_prefix, add_special_tokens=False)["input_ids"]
    full = tokenizer(f"{needle.answer_prefix} {needle.answer}", add_special_tokens=False)["input_ids"]
    return max(1, len(full) - len(prefix))


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for source in (model.generation_config.eos_token_id, model.config.eos_token_id, tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids


def compute_head_scores(
    model,
    tokenizer,
    context_lengths: list[int],
    depths: list[int],
    needles: tuple[Needle, ...] = NEEDLES,
    seed: int = 0,
    include_failed: bool = False,
    max_new_tokens: int = 50,
    log=print,
) -> dict[str, list[float]]:
    """Run every (needle, context length, depth) probe; each counted probe appends one score
    per query head. Raises ``NoHeadScores`` if no probe was counted or every score is zero."""
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    per_head: dict[str, list[float]] = {head_key(layer, head): [] for layer in range(layers) for head in range(heads)}
    counted = 0
    for needle_index, needle in enumerate(needles):
        for length in context_lengths:
            for depth in depths:
                probe = build_probe(tokenizer, needle, length, depth, seed=seed + needle_index)
                scores, answer_ids = probe_head_scores(model, tokenizer, probe, max_new_tokens)
                answer = tokenizer.decode(answer_ids, skip_special_tokens=True).strip()
                f1 = qa_f1_score(answer, needle.answer)
                use = include_failed or f1 > 0.5
                log(
                    f"needle {needle_index} length {probe.input_ids.shape[-1]} depth {depth}%: "
                    f"answer {answer!r} F1 {f1:.2f}{'' if use else ' (not counted)'}"
                )
                if use:
                    counted += 1
                    # per_head's keys and the flattened [layers, heads] scores are both layer-major.
                    for name, value in zip(per_head, scores.flatten().tolist()):
                        per_head[name].append(float(f"{value:.4g}"))  # 4 digits keep the file small
    if counted == 0:
        raise NoHeadScores(
            "no probe was answered correctly, so no head scores were collected; try shorter --context_lengths "
            "or pass --include_failed"
        )
    if not any(value > 0 for values in per_head.values() for value in values):
        raise NoHeadScores(
            f"every head scored 0 over the {counted} counted probes (no decoded token's top attention fell in a "
            "needle): a file --head_scores would refuse, so none is written; try more --max_new_tokens or other "
            "--context_lengths"
        )
    log(f"{counted} probes counted")
    return per_head


def build_parser() -> argparse.ArgumentParser:
    from restkv.integrations.transformers.models import DTYPES

    parser = argparse.ArgumentParser(
        prog="python -m restkv.tools.head_scores",
        description="Compute HeadKV retrieval-reasoning head scores with offline needle-in-a-haystack probes.",
    )
    parser.add_argument("--model_path", required=True, help="embedded model name (smollm2-135m), folder or hub id")
    parser.add_argument(
        "--out", default=None,
        help="output JSON (default data/heads_score/<model>_retrieval_reasoning_heads.json)",
    )
    parser.add_argument("--context_lengths", type=int, nargs="+", default=[1000, 2000, 4000],
                        help="approximate prompt lengths in tokens")
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 25, 50, 75, 100],
                        help="needle insertion depths, percent of the haystack")
    parser.add_argument("--num_needles", type=int, default=len(NEEDLES), help=f"how many of the {len(NEEDLES)} needles")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic haystack")
    parser.add_argument("--include_failed", action="store_true", help="also count probes answered wrongly")
    parser.add_argument("--max_new_tokens", type=int, default=50,
                        help="decode limit per probe (each decoded token scores the heads)")
    parser.add_argument("--dtype", default=None, choices=list(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    add_config_flags(parser)
    return parser


@command_line
def main(argv: list[str] | None = None) -> Path:
    from restkv.integrations.transformers.models import (check_model_path, load_model, load_tokenizer, model_label,
                                                         model_path_errors)

    args, parser = parse_command_line(build_parser, argv)
    if not 1 <= args.num_needles <= len(NEEDLES):
        parser.error(f"--num_needles must lie in [1, {len(NEEDLES)}]")
    if any(d < 0 or d > 100 for d in args.depths):
        parser.error("--depths are percentages in [0, 100]")
    if any(n < 16 for n in args.context_lengths):
        parser.error("--context_lengths must be at least 16 tokens")
    if args.max_new_tokens < 1:
        parser.error(f"--max_new_tokens must be >= 1 (each decoded step scores the heads); got {args.max_new_tokens}")
    try:
        out = check_output_path(
            args.out or f"data/heads_score/{model_label(args.model_path)}_retrieval_reasoning_heads.json", "--out")
    except FlagError as error:
        parser.error(str(error))

    check_model_path(args.model_path)
    with model_path_errors(args.model_path):
        model = load_model(args.model_path, attn_implementation="eager", dtype=args.dtype)
        tokenizer = load_tokenizer(args.model_path)
    scores = compute_head_scores(
        model, tokenizer, args.context_lengths, args.depths, NEEDLES[: args.num_needles],
        seed=args.seed, include_failed=args.include_failed, max_new_tokens=args.max_new_tokens,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    save_head_scores(out, scores)
    print(out)
    return out


if __name__ == "__main__":
    main()
