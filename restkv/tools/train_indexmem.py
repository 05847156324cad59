"""Train IndexMem's indexer and latent memory by block-wise self-distillation (backbone frozen).

    python -m restkv.tools.train_indexmem --model_path smollm2-135m --output indexmem-smollm2.pt

One forward of the frozen full-cache model over each training sequence captures every
layer's queries, keys and values, after RoPE (what attention and the indexer read) and before
it (what the memory and its gate read, ``--memory_inputs pre_rope``, the paper's memory without
position; ``post_rope`` trains on the rotated ones); every layer's parts then train on local
losses at a few random block ends ``e`` of the sequence (each a simulated compression of the
prefix ``[0, e)`` with the observation window ``[e - W, e)``):

* **indexer**: ``KL(teacher || student)`` over the candidates ``[0, e - W)``, the teacher being
  the model's own attention reduced over each query group (``--indexer_target window``: the
  window's queries, the ones the indexer reads; ``future``: the
  next ``--future`` queries, what later tokens will need);
* **memory**: the indexer keeps ``--kept_fraction`` of the prefix, the rest is written into
  the memory, and ``--future`` queries at distances drawn from the first ``--read_distance``
  tokens after ``e`` (as the question and answer tokens read a compressed prompt: each reads
  the kept tokens and every token from ``e`` to itself) are corrected with the memory's read;
  the loss is the squared error to the full-cache attention output divided by the
  uncorrected one's (below 1 = the memory helps).

The text is ``--text_file`` (plain text) or the library's synthetic prose (``restkv.benchmarks.text``).
The file ``--output`` is what ``--indexmem_weights`` loads.
"""

from __future__ import annotations

import argparse
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from restkv.benchmarks.config_file import add_config_flags, parse_command_line
from restkv.benchmarks.flags import check_output_path
from restkv.benchmarks.text import synthetic_prose
from restkv.cache.partial import Probe, reference_kernel
from restkv.config.options import ConfigError
from restkv.integrations.transformers.capture import attention_inputs
from restkv.integrations.transformers.models import check_model_path, load_frozen
from restkv.integrations.transformers.rotation import undoable_rotary
from restkv.learned.indexmem import (FUSIONS, INDEXER_FORMS, MEMORY_INPUTS, QUERY_REDUCTIONS, Architecture,
                                     IndexMemLayer, IndexMemWeights)
from restkv.scoring.rope import unrotate
from restkv.scoring.selection import gather_columns, rank_keys, select_columns
from restkv.scoring.window import pool_scores, reduce_groups, window_attention

SYNTHETIC_TEXT = "synthetic-prose"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default="smollm2-135m")
    parser.add_argument("--output", default="indexmem.pt", help="weights file to write (what --indexmem_weights loads)")
    parser.add_argument("--text_file", default=None, help="plain-text training data (default: synthetic prose)")
    parser.add_argument("--num_sequences", type=int, default=8, help="training sequences cut from the text")
    parser.add_argument("--seq_len", type=int, default=1024, help="tokens per training sequence")
    parser.add_argument("--steps_per_sequence", type=int, default=4, help="optimiser steps on each captured sequence")
    parser.add_argument("--blocks", type=int, default=4, help="random block ends per step")
    parser.add_argument("--window_size", type=int, default=32, help="observation window of the simulated compressions")
    parser.add_argument("--future", type=int, default=64,
                        help="queries after a block end that read the memory (and the indexer's future target)")
    parser.add_argument("--read_distance", type=int, default=256,
                        help="the memory's reading queries are drawn from this many tokens after a block end")
    parser.add_argument("--memory_inputs", choices=MEMORY_INPUTS, default="pre_rope",
                        help="what the memory and its gate read: keys and queries before RoPE (the paper) or after")
    parser.add_argument("--kept_fraction", type=float, default=0.2, help="prefix share the simulated compressions keep")
    parser.add_argument("--indexer_target", choices=("window", "future"), default="window")
    parser.add_argument("--indexmem_features", type=int, default=32)
    parser.add_argument("--indexer_form", choices=INDEXER_FORMS, default="dot")
    parser.add_argument("--indexer_heads", type=int, default=4, help="indexer heads of the dsa form")
    parser.add_argument("--indexmem_query_reduction", choices=QUERY_REDUCTIONS, default="mean")
    parser.add_argument("--indexmem_fusion", choices=FUSIONS, default="residual")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warm-up, steady, decay)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (the per-layer losses are small tensors: one thread is usually fastest)")
    add_config_flags(parser)
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Every check that needs no model, before the model loads (``ValueError`` naming the flag):
    a bad value found after the training would lose it."""
    check_model_path(args.model_path)
    if args.text_file is not None and not Path(args.text_file).is_file():
        raise ValueError(f"--text_file {args.text_file!r}: no such file")
    check_output_path(args.output, "--output")
    if not 0 < args.kept_fraction < 1:
        raise ValueError(f"--kept_fraction must lie in (0, 1); got {args.kept_fraction}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr must be > 0; got {args.lr}")
    for flag in ("num_sequences", "steps_per_sequence", "blocks", "window_size", "future", "indexmem_features",
                 "indexer_heads", "threads"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be at least 1; got {getattr(args, flag)}")
    if args.read_distance < args.future:
        raise ValueError(f"--read_distance {args.read_distance} must be at least --future {args.future} (the reading "
                         "queries are distinct)")
    shortest = 2 * args.window_size + args.read_distance + 1
    if args.seq_len < shortest:
        raise ValueError(f"--seq_len {args.seq_len} must be at least 2 x --window_size + --read_distance + 1 = "
                         f"{shortest}")


def training_sequences(tokenizer, args: argparse.Namespace) -> list[torch.Tensor]:
    """``--num_sequences`` consecutive pieces of ``--seq_len`` tokens of the training text."""
    wanted = args.num_sequences * args.seq_len
    if args.text_file is not None:
        ids = tokenizer(Path(args.text_file).read_text(encoding="utf-8"), add_special_tokens=False).input_ids
        if len(ids) < args.seq_len:
            raise ValueError(f"--text_file {args.text_file!r} holds {len(ids)} tokens, fewer than --seq_len")
    else:
        words = wanted
        while len(ids := tokenizer(synthetic_prose(words), add_special_tokens=False).input_ids) < wanted:
            words *= 2
    count = min(args.num_sequences, len(ids) // args.seq_len)
    return [torch.tensor(ids[i * args.seq_len : (i + 1) * args.seq_len])[None] for i in range(count)]


@dataclass
class CapturedLayer:
    """One layer's float32 ``[1, H | H_kv, n, d]`` tensors of a full-cache forward: the post-RoPE
    queries, keys and values, and the queries and keys before RoPE."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    pre_rope_query: torch.Tensor
    pre_rope_key: torch.Tensor

    def memory_inputs(self, which: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries and keys the memory reads (``--memory_inputs``)."""
        return (self.pre_rope_query, self.pre_rope_key) if which == "pre_rope" else (self.query, self.key)


def capture_layers(model, input_ids: torch.Tensor) -> list[CapturedLayer]:
    """Every layer's ``CapturedLayer`` of one full-cache forward (pre-RoPE: ``restkv.scoring.rope.unrotate``
    with the tables the compressed path turns the layer with,
    ``restkv.integrations.transformers.rotation.undoable_rotary``)."""
    captured: dict[int, CapturedLayer] = {}
    hooks = []
    for index, block in enumerate(model.model.layers):
        def hook(module, args, kwargs, index=index):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            query, key, value = (t.float() for t in attention_inputs(module, hidden, (cos, sin)))
            tables = undoable_rotary(module, (cos, sin), hidden, key.shape[-1])
            captured[index] = CapturedLayer(query, key, value, unrotate(query, *tables), unrotate(key, *tables))
        hooks.append(block.self_attn.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad(), warnings.catch_warnings():  # a full-cache forward on purpose, patched or not
            warnings.filterwarnings("ignore", message="restkv: this forward has no cache")
            model(input_ids=input_ids, use_cache=False)
    finally:
        for handle in hooks:
            handle.remove()
    return [captured[index] for index in range(len(captured))]


def read_distances(args: argparse.Namespace, generator: torch.Generator) -> torch.Tensor:
    """``--future`` distinct distances (ascending) among the first ``--read_distance`` tokens after a
    block end: where the memory's reading queries sit."""
    return torch.randperm(args.read_distance, generator=generator)[: args.future].sort().values


def read_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, columns: torch.Tensor, end: int,
                   distances: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention of the queries at ``end + distances`` as a compressed cache gives it (the
    kept ``columns`` ``[1, H_kv, k]`` of ``[0, end)``, then every token from ``end`` to the query,
    exact), its log-sum-exp, and as the full cache gives it: ``[1, H, n, d]``, ``[1, H, n]``,
    ``[1, H, n, d]`` (float32)."""
    span, kv = int(distances.max()) + 1, key.shape[1]
    read_query = query[:, :, end + distances]
    probe = Probe(read_query, kv, end, scaling, need_lse=True)
    query_columns = (end + distances)[None, None, :, None]

    def seen(held: torch.Tensor) -> torch.Tensor:  # [1, H_kv, S] columns -> [1, H_kv, G * n, S]
        visible = (held[:, :, None, :] >= 0) & (held[:, :, None, :] <= query_columns)
        return visible[:, :, None].expand(-1, -1, probe.groups, -1, -1).reshape(1, kv, -1, held.shape[-1])

    tail_columns = torch.arange(end, end + span).expand(1, kv, -1)
    main = reference_kernel(probe, torch.cat([gather_columns(key, columns), key[:, :, end : end + span]], 2),
                            torch.cat([gather_columns(value, columns), value[:, :, end : end + span]], 2),
                            seen(torch.cat([columns, tail_columns], dim=2)))
    full = reference_kernel(probe, key[:, :, : end + span], value[:, :, : end + span],
                            seen(torch.arange(end + span).expand(1, kv, -1)))
    return (probe.interface(main.output).transpose(1, 2).float(), probe.per_query_head(main.lse),
            probe.interface(full.output).transpose(1, 2).float())


def block_losses(layer: IndexMemLayer, captured: CapturedLayer, scaling: float, end: int, distances: torch.Tensor,
                 args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's KL and the memory's relative error at one simulated compression of ``[0, end)``,
    the memory read by the queries at ``end + distances``."""
    query, key, value = captured.query, captured.key, captured.value
    window, future, kv = args.window_size, args.future, key.shape[1]
    valid = torch.ones(1, end, dtype=torch.bool)
    candidates = torch.arange(end) < end - window
    student = reduce_groups(layer.importance(query[:, :, :end], key[:, :, :end], valid, window,
                                             args.indexmem_query_reduction), kv)
    with torch.no_grad():
        if args.indexer_target == "window":
            teacher = window_attention(query[:, :, :end], key[:, :, :end], valid, window, scaling).mean(dim=2)
        else:
            stop = end + future
            teacher = window_attention(query[:, :, :stop], key[:, :, :stop], torch.ones(1, stop, dtype=torch.bool),
                                       future, scaling).mean(dim=2)[..., :end]
        teacher = reduce_groups(teacher, kv)[..., candidates]
        teacher = teacher / teacher.sum(dim=-1, keepdim=True)
    picked = student[..., candidates]
    picked = picked / picked.sum(dim=-1, keepdim=True)
    kl = (teacher * (teacher.clamp_min(1e-12).log() - picked.clamp_min(1e-12).log())).sum(dim=-1).mean()

    with torch.no_grad():
        protected = (~candidates)[None]
        scores = pool_scores(student.detach(), candidates[None], "avgpool", 5)
        budget = max(int(args.kept_fraction * end), window + 1)
        columns = select_columns(rank_keys(scores, valid, protected), torch.full((1, kv), budget))
        kept = torch.zeros(1, kv, end, dtype=torch.bool).scatter_(2, columns, True)
        main, lse, full = read_attention(query, key, value, columns, end, distances, scaling)
        baseline = (main - full).square().sum().clamp_min(1e-12)
    memory_query, memory_key = captured.memory_inputs(args.memory_inputs)
    state = layer.write(memory_key[:, :, :end], value[:, :, :end], ~kept, torch.arange(end - 1, -1, -1), scaling)
    reading = memory_query[:, :, end + distances]
    readout, log_mass = layer.read(state, reading, scaling)
    fused = layer.fuse(main, lse, readout, log_mass, reading, args.indexmem_fusion)
    return kl, (fused - full).square().sum() / baseline


def learning_rate(step: int, total: int, peak: float) -> float:
    """Warm-up over the first 10% of steps, steady to 60%, then linear decay to 0.75% of the peak
    (the paper's warm-up/steady/decay shape, 1e-3 -> 7.5e-6, at this run's length)."""
    warm, steady = max(1, total // 10), int(0.6 * total)
    if step < warm:
        return peak * (step + 1) / warm
    if step < steady:
        return peak
    return peak * (1 - (1 - 0.0075) * (step - steady) / max(1, total - steady))


def train(model, sequences: list[torch.Tensor], args: argparse.Namespace) -> IndexMemWeights:
    """Train every layer's parts on ``sequences`` (``[1, n]`` token ids each) of the frozen ``model``."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    arch = Architecture(config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, head_dim,
                        args.indexmem_features, args.indexer_form,
                        args.indexer_heads if args.indexer_form == "dsa" else 1, fusion=args.indexmem_fusion,
                        memory_inputs=args.memory_inputs)
    layers = [IndexMemLayer(arch, index, args.seed) for index in range(arch.num_layers)]
    scalings = [block.self_attn.scaling for block in model.model.layers]
    optimizer = torch.optim.AdamW([p for layer in layers for p in layer.parameters()], lr=args.lr, weight_decay=0.0)
    total = len(sequences) * args.steps_per_sequence
    rng = torch.Generator().manual_seed(args.seed)
    started, step, history = time.perf_counter(), 0, []
    progress = tqdm(total=total, desc="indexmem", unit="step")
    for ids in sequences:
        captured = capture_layers(model, ids)
        lowest, highest = 2 * args.window_size + 1, ids.shape[1] - args.read_distance
        for _ in range(args.steps_per_sequence):
            ends = torch.randint(lowest, highest + 1, (args.blocks,), generator=rng).tolist()
            distances = [read_distances(args, rng) for _ in ends]
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, total, args.lr)
            optimizer.zero_grad()
            kl_sum = memory_sum = 0.0
            for layer, layer_capture, scaling in zip(layers, captured, scalings):
                losses = [block_losses(layer, layer_capture, scaling, end, reads, args)
                          for end, reads in zip(ends, distances)]
                kl = sum(loss[0] for loss in losses) / len(ends)
                memory = sum(loss[1] for loss in losses) / len(ends)
                (kl + memory).backward()
                kl_sum, memory_sum = kl_sum + kl.item(), memory_sum + memory.item()
            optimizer.step()
            step += 1
            history.append((kl_sum / len(layers), memory_sum / len(layers)))
            progress.set_postfix(kl=f"{history[-1][0]:.4f}", memory_error=f"{history[-1][1]:.3f}")
            progress.update()
    progress.close()
    seconds = time.perf_counter() - started
    first, last = history[0], history[-1]
    training = dict(model=args.model_path, text=args.text_file or SYNTHETIC_TEXT, sequences=len(sequences),
                    seq_len=args.seq_len, tokens=sum(ids.shape[1] for ids in sequences), steps=step,
                    seconds=round(seconds, 1),
                    indexer_target=args.indexer_target, kept_fraction=args.kept_fraction,
                    memory_inputs=args.memory_inputs, read_distance=args.read_distance,
                    query_reduction=args.indexmem_query_reduction, first_losses=first, last_losses=last)
    return IndexMemWeights(arch, [layer.requires_grad_(False) for layer in layers], training)


def main(argv: list[str] | None = None) -> IndexMemWeights:
    """The command line; bad input (flags, a model that does not load) is one ``error:`` line."""
    args, _ = parse_command_line(build_parser, argv)
    try:
        check_args(args)
        model, tokenizer = load_frozen(args.model_path)
        sequences = training_sequences(tokenizer, args)
    except ValueError as error:  # a flag, a --model_path (ModelPathError), too short a --text_file
        raise SystemExit(f"error: {error}") from None
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    try:
        weights = train(model, sequences, args)
    except ConfigError as error:  # a layer whose RoPE restkv cannot undo (no pre-RoPE keys), at the first sequence
        raise SystemExit(f"error: {error}") from None
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    weights.save(args.output)
    info = weights.training
    print(f"wrote {args.output}: {info['steps']} steps on {info['tokens']} tokens of {info['text']} in "
          f"{info['seconds']} s; indexer KL {info['first_losses'][0]:.4f} -> {info['last_losses'][0]:.4f}, "
          f"memory error ratio {info['first_losses'][1]:.3f} -> {info['last_losses'][1]:.3f}")
    return weights


if __name__ == "__main__":
    main()
