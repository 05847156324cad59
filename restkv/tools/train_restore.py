"""Train ``--method restorekv``'s restore embeddings and adapter by self-distillation from the full cache.

    python -m restkv.tools.train_restore --model_path smollm2-135m --output restorekv.safetensors

Each training sequence (``restkv.learned.training_text``: generated prose that shares nothing with what
the weights are judged on) is cut into a prompt (the chat template's opening, then ``--context_tokens``
tokens of text: the context span KVzip compresses) and a continuation that plays the question and the
answer: the text's next tokens, then a span of the context repeated (what a question asks back). One
step, batch 1:

1. KVzip's kept set, without gradients: the prompt prefilled under ``--method kvzip`` with each head's
   budget ``n`` tokens short (``restorekv``'s eviction: the restore tokens fill ``n`` slots), at a
   compression ratio drawn from ``--ratios``;
2. the teacher: the plain model over prompt and continuation (the full cache), its next-token
   distributions on the continuation;
3. the student, differentiable: the restore embeddings run after the whole context with the adapter on
   (their K/V with gradients), then the continuation through the plain model at the positions after the
   context (as ``--method restorekv`` places it), each layer's query reading only its kept context
   tokens (per KV head), the restore tokens and the continuation before it (``StudentAttention``);
4. the loss: the mean KL divergence of the student's distributions from the teacher's over the
   continuation; AdamW on the embeddings and the adapter only.

The check is on text it never saw: ``--held_out`` sequences of each ``--held_out_types`` type
(``restkv.benchmarks.heldout_text``), cut the same way, on which the command reports per
``--check_ratio`` the KL divergence from the full cache of KVzip at the whole budget and of the restore
tokens with KVzip at the budget less ``n`` (the same memory), and each type's overlap with the
training text. No file is written without that report; it goes into the file's metadata with how the
weights were made (``restkv.learned.restore``).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AttentionInterface, DynamicCache

from restkv.benchmarks.heldout_text import held_out_sequences
from restkv.cache import kept_positions
from restkv.integrations.transformers.compat import with_cache
from restkv.integrations.transformers.deferred import listening_to_scores
from restkv.integrations.transformers.generation import prefill
from restkv.integrations.transformers.patching import compression
from restkv.integrations.transformers.reconstruction_prompt import set_reconstruction_prompt, template_opening
from restkv.learned.restore import RestoreWeights, new_restore_weights, save_restore_weights
from restkv.learned.training_text import training_sequences
from restkv.tools.train_scorer import (CORPUS_NAME, add_held_out_flags, check_trainer_args, loaded_for_training,
                                       overlap_report)

#: the attention implementation the student's continuation runs with (``StudentAttention``)
STUDENT_ATTENTION = "restkv_restore_student"


class StudentAttention:
    """The student's attention, given each layer's kept columns (``kept``: ``{layer: [H_kv, N] bool}``, set
    around the student's forward): a query reads each KV head's kept columns of the first ``N`` keys, every
    key after them up to its own tokens (the restore tokens), and its own tokens causally. That is what
    ``--method restorekv``'s cache holds, with evicted tokens masked instead of removed."""

    def __init__(self) -> None:
        self.kept: dict[int, torch.Tensor] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        kept = self.kept[module.layer_idx].to(query.device)  # [H_kv, N]
        kv_heads, rows, total = key.shape[1], query.shape[2], key.shape[2]
        groups = query.shape[1] // kv_heads
        earlier = torch.cat([kept, kept.new_ones(kv_heads, total - rows - kept.shape[-1])], dim=-1)
        own = torch.ones(rows, rows, dtype=torch.bool, device=query.device).tril()
        mask = torch.cat([earlier[:, None, :].expand(-1, rows, -1), own.expand(kv_heads, -1, -1)], dim=-1)
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1),
            attn_mask=mask.repeat_interleave(groups, dim=0)[None], scale=scaling)
        return output.transpose(1, 2).contiguous(), None


STUDENT = StudentAttention()
AttentionInterface.register(STUDENT_ATTENTION, STUDENT)


def kept_masks(kept: list, length: int) -> dict[int, torch.Tensor]:
    """``{layer: [H_kv, length] bool}`` from ``restkv.kept_positions`` of one row (row-local positions)."""
    masks = {}
    for index, layer in enumerate(kept):
        mask = torch.zeros(len(layer.exact[0]), length, dtype=torch.bool)
        for head, positions in enumerate(layer.exact[0]):
            mask[head, positions] = True
        masks[index] = mask
    return masks


@dataclass
class Example:
    """One prompt and continuation, ready for any number of steps: the prompt's full K/V per layer, KVzip's
    kept set, and the teacher's log-distributions ``[T, vocab]`` on the continuation."""

    continuation: torch.Tensor
    keys_values: dict[int, tuple[torch.Tensor, torch.Tensor]]
    kept: dict[int, torch.Tensor]
    teacher_log: torch.Tensor

    @property
    def length(self) -> int:
        return next(iter(self.kept.values())).shape[-1]

    def context(self) -> DynamicCache:
        """A cache of the full prompt, which a student may extend."""
        cache = DynamicCache()
        for index, (key, value) in sorted(self.keys_values.items()):
            cache.update(key, value, index)
        return cache


def prepare(model, prompt: torch.Tensor, continuation: torch.Tensor, span: tuple[int, int], budget: int,
            chunk: int) -> Example:
    """``prompt`` ``[1, N]`` prefilled under ``--method kvzip`` at ``budget`` tokens per KV head (its kept set, and
    the full K/V each layer held before eviction), and the teacher: ``continuation`` ``[1, T]`` over that full
    cache. No gradients."""
    keys_values = {}

    def keep(ctx, scores):
        keys_values[ctx.layer_idx] = (ctx.key.detach().clone(), ctx.value.detach().clone())

    with torch.no_grad():
        with compression(model, method="kvzip", max_capacity_prompts=budget, reconstruction_chunk=chunk), \
                listening_to_scores(keep):
            kept = kept_masks(kept_positions(prefill(model, prompt, context_span=span)), prompt.shape[-1])
        example = Example(continuation, keys_values, kept, torch.empty(0))
        positions = torch.arange(example.length, example.length + continuation.shape[-1])[None]
        logits = model(input_ids=continuation, position_ids=positions, **with_cache(example.context())).logits
    example.teacher_log = logits[0].float().log_softmax(dim=-1)
    return example


def student_logits(model, weights: RestoreWeights | None, example: Example) -> torch.Tensor:
    """``[1, T, vocab]`` the student's logits of the example's continuation: ``weights``' restore tokens run
    after the whole prompt with the adapter on (None: no restore tokens, KVzip alone), then the continuation
    reads the kept columns (``StudentAttention``), the restore tokens and itself, at the positions after the
    prompt. Differentiable in ``weights``."""
    cache, length = example.context(), example.length
    if weights is not None:  # the model's own attention over the whole context
        decoder = model.get_decoder()
        positions = torch.arange(length, length + weights.tokens)[None]
        with weights.adapted(decoder):
            decoder(inputs_embeds=weights.embeddings[None].to(model.dtype), position_ids=positions, use_cache=True,
                    **with_cache(cache))
    previous = model.config._attn_implementation
    model.set_attn_implementation(STUDENT_ATTENTION)
    STUDENT.kept = example.kept
    try:
        positions = torch.arange(length, length + example.continuation.shape[-1])[None]
        return model(input_ids=example.continuation, position_ids=positions, **with_cache(cache)).logits
    finally:
        STUDENT.kept = {}
        model.set_attn_implementation(previous)


def divergence(example: Example, logits: torch.Tensor) -> torch.Tensor:
    """The mean over the continuation's positions of KL(teacher || student)."""
    student_log = logits[0].float().log_softmax(dim=-1)
    return (example.teacher_log.exp() * (example.teacher_log - student_log)).sum(dim=-1).mean()


def cut(sequence: list[int], opening: list[int], context_tokens: int, continuation_tokens: int,
        rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """A sequence's prompt (opening + context), continuation (the text's next tokens, then a span of the context
    repeated) and the context's span."""
    context = sequence[:context_tokens]
    following = continuation_tokens // 2
    start = rng.randrange(0, context_tokens - (continuation_tokens - following))
    repeated = context[start : start + continuation_tokens - following]
    prompt = torch.tensor([opening + context])
    continuation = torch.tensor([sequence[context_tokens : context_tokens + following] + repeated])
    return prompt, continuation, (len(opening), prompt.shape[-1])


def budget_of(length: int, ratio: float) -> int:
    """Tokens per KV head kept of ``length`` at ``ratio`` (``--compression_ratio``'s rounding)."""
    return length - int(length * ratio)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m restkv.tools.train_restore", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default="smollm2-135m")
    parser.add_argument("--output", default="restorekv.safetensors", help="weights file (what --restore_weights "
                        "loads)")
    parser.add_argument("--num_sequences", type=int, default=48, help="training sequences (one step each per epoch)")
    parser.add_argument("--epochs", type=int, default=4, help="passes over the training sequences")
    parser.add_argument("--context_tokens", type=int, default=384, help="text tokens of each context")
    parser.add_argument("--continuation_tokens", type=int, default=32,
                        help="tokens of each continuation (the text's next half, a repeated span of the context)")
    parser.add_argument("--restore_tokens", type=int, default=8, help="restore tokens n (the paper's 8)")
    parser.add_argument("--rank", type=int, default=4, help="rank of the adapter on q/k/v/o_proj")
    parser.add_argument("--lora_scale", type=float, default=2.0, help="factor of the adapter's low-rank term")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.9, 0.8],
                        help="compression ratios the steps draw from (0.9: 10%% kept)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate (cosine schedule)")
    add_held_out_flags(parser)
    parser.set_defaults(held_out=1)
    parser.add_argument("--check_ratio", type=float, nargs="+", default=[0.9, 0.8],
                        help="compression ratios of the held-out check")
    parser.add_argument("--reconstruction_chunk", type=int, default=2048, help="KVzip's chunk while scoring")
    parser.add_argument("--seed", type=int, default=0, help="the training text's, the start's and the order's seed")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Every check that needs no model, before the model loads (``ValueError`` naming the flag)."""
    check_trainer_args(args, "restore weights", ("num_sequences", "epochs", "restore_tokens", "rank",
                                                 "reconstruction_chunk"))
    if args.continuation_tokens < 2:
        raise ValueError(f"--continuation_tokens must be at least 2; got {args.continuation_tokens}")
    if args.context_tokens < args.continuation_tokens:
        raise ValueError(f"--context_tokens {args.context_tokens} must hold the repeated span "
                         f"(at least --continuation_tokens {args.continuation_tokens})")
    for flag in ("ratios", "check_ratio"):
        for ratio in getattr(args, flag):
            if not 0 < ratio < 1:
                raise ValueError(f"--{flag} must lie in (0, 1); got {ratio}")
            if budget_of(args.context_tokens, ratio) <= args.restore_tokens + 4:
                raise ValueError(f"--{flag} {ratio} keeps {budget_of(args.context_tokens, ratio)} of "
                                 f"--context_tokens {args.context_tokens}: not more than the {args.restore_tokens} "
                                 "restore tokens and KVzip's 4 sinks")
    if not args.lr > 0 or not args.lora_scale > 0:
        raise ValueError(f"--lr and --lora_scale must be > 0; got {args.lr}, {args.lora_scale}")


def held_out_report(model, tokenizer, args, weights: RestoreWeights, opening: list[int],
                    texts: list[list[int]]) -> dict:
    """Per held-out type: the KL divergence from the full cache of KVzip at the whole budget and of RestoreKV
    (KVzip at the budget less the restore tokens, and the restore tokens) at each check ratio."""
    report = {}
    rng = random.Random(f"{args.seed}:held-out")
    for text_type in args.held_out_types:
        sequences = held_out_sequences(tokenizer, text_type, args.held_out,
                                       args.context_tokens + args.continuation_tokens, args.seed)
        divergences = {f"{method}_kl": {f"{ratio:g}": [] for ratio in args.check_ratio}
                       for method in ("kvzip", "restorekv")}
        with torch.no_grad():
            for sequence in tqdm(sequences, desc=f"held-out {text_type}"):
                prompt, continuation, span = cut(sequence, opening, args.context_tokens, args.continuation_tokens, rng)
                for ratio in args.check_ratio:
                    budget = budget_of(prompt.shape[-1], ratio)
                    for method, used in (("kvzip", None), ("restorekv", weights)):
                        kept = budget - (used.tokens if used is not None else 0)
                        example = prepare(model, prompt, continuation, span, kept, args.reconstruction_chunk)
                        loss = divergence(example, student_logits(model, used, example))
                        divergences[f"{method}_kl"][f"{ratio:g}"].append(float(loss))
        report[text_type] = {"sequences": len(sequences), **overlap_report(tokenizer, texts, sequences),
                             **{name: {ratio: sum(values) / len(values) for ratio, values in by_ratio.items()}
                                for name, by_ratio in divergences.items()}}
    return report


def held_out_table(held_out: dict) -> str:
    """The held-out report as a Markdown table: per type and check ratio, KVzip's and RestoreKV's KL divergence
    from the full cache (same memory), and the type's overlap with the training text."""
    ratios = list(next(iter(held_out.values()))["kvzip_kl"])
    columns = ["type", *(f"{method} KL r={ratio}" for ratio in ratios for method in ("kvzip", "restorekv")),
               "token 8-gram overlap"]
    rows = [[name, *(f"{report[f'{method}_kl'][ratio]:.4f}" for ratio in ratios for method in ("kvzip", "restorekv")),
             f"{report['token_overlap']:.2%}"] for name, report in held_out.items()]
    return "\n".join(["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns),
                      *("| " + " | ".join(row) + " |" for row in rows)])


def main(argv: list[str] | None = None) -> RestoreWeights:
    """The command line; bad input (flags, a model that does not load) is one ``error:`` line."""
    args = build_parser().parse_args(argv)
    model, tokenizer = loaded_for_training(args, check_args)
    set_reconstruction_prompt(model, tokenizer)
    opening = tokenizer(template_opening(tokenizer), add_special_tokens=False).input_ids
    if not opening and tokenizer.bos_token_id is not None:
        opening = [tokenizer.bos_token_id]
    generator = torch.Generator().manual_seed(args.seed)
    weights = new_restore_weights(model.get_decoder(), args.restore_tokens, args.rank, args.lora_scale, generator)
    parameters = [tensor.requires_grad_() for tensor in weights.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=args.lr)
    texts = training_sequences(tokenizer, args.num_sequences, args.context_tokens + args.continuation_tokens,
                               args.seed)
    rng = random.Random(f"{args.seed}:steps")
    started, examples = time.time(), []
    for index, sequence in enumerate(tqdm(texts, desc=f"KVzip and the teacher ({args.model_path})")):
        prompt, continuation, span = cut(sequence, opening, args.context_tokens, args.continuation_tokens, rng)
        budget = budget_of(prompt.shape[-1], args.ratios[index % len(args.ratios)]) - args.restore_tokens
        examples.append(prepare(model, prompt, continuation, span, budget, args.reconstruction_chunk))
    steps = args.epochs * len(examples)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    losses = []
    progress = tqdm(total=steps, desc="distilling restore tokens")
    for _ in range(args.epochs):
        for index in torch.randperm(len(examples), generator=generator).tolist():
            with torch.enable_grad():
                loss = divergence(examples[index], student_logits(model, weights, examples[index]))
                optimizer.zero_grad()
                loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            progress.update()
            progress.set_postfix(kl=f"{sum(losses[-len(examples):]) / len(losses[-len(examples):]):.4f}")
    progress.close()
    for tensor in parameters:
        tensor.requires_grad_(False)
    held_out = held_out_report(model, tokenizer, args, weights, opening, texts)
    training = {"model_path": args.model_path, "text": CORPUS_NAME, "sequences": len(texts),
                "context_tokens": args.context_tokens, "continuation_tokens": args.continuation_tokens,
                "restore_tokens": args.restore_tokens, "rank": args.rank, "lora_scale": args.lora_scale,
                "ratios": args.ratios, "epochs": args.epochs, "lr": args.lr, "seed": args.seed,
                "reconstruction_chunk": args.reconstruction_chunk, "seconds": round(time.time() - started),
                "first_epoch_kl": sum(losses[:len(texts)]) / len(texts),
                "last_epoch_kl": sum(losses[-len(texts):]) / len(texts),
                "held_out": held_out}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    save_restore_weights(args.output, weights, training)
    trained = sum(tensor.numel() for tensor in parameters)
    total = sum(parameter.numel() for parameter in model.parameters())
    print(f"wrote {args.output}: {args.restore_tokens} restore tokens and a rank-{args.rank} adapter, {trained} "
          f"numbers ({trained / total:.2%} of the model) from {len(texts)} sequences in {time.time() - started:.0f} s")
    print(held_out_table(held_out))
    return weights


if __name__ == "__main__":
    main()
