"""ThinK's key-channel pruning (Xu et al., 2024, arXiv 2407.21018), the ``--think`` switch.

After a layer's tokens are selected, each KV head drops the ``floor(pruning_ratio * d)`` key
channels with the smallest score ``mean_w(q_c^2) * mean_n(k_c^2)`` (``q``: the observation
window's queries of the head's query group, their energies averaged over the group; ``k``:
every entry the layer keeps, the recent tokens included, as ThinK's release computes it),
the squared form of ThinK's ``|Q_c| |K_c|``. The newest ``--recent_size`` prompt tokens keep
every channel (they are what the next queries read most), as do tokens appended later.

Where this differs from ThinK's release: it repeats the keys per query head before pruning
and picks each query head's channels from that head's queries alone, storing one pruned copy
per query head; here one channel set per KV head is stored once (the group's energies
averaged; on SmolLM2 at budget 128 and ratio 0.4, 21% of the pruned channels differ). That variant needs key
storage per query head (or a ragged union of channels per KV head with per-query-head query
masks at decode), which the cache does not have. The release also prunes layers whose prompt
fits the budget; here only layers that evict are compressed, so those keep the native cache.

Storage (``restkv.cache.CompressedLayer``): the pruned keys hold only the kept channels
(``[B, H_kv, S, d - pruned]``) with their indices per head (``key_channels``); the query
channels that meet them are selected at decode, which is the same as masking the dropped
ones. The recent tokens, whole, open the layer's tail. ``compress_kv`` and ``Selection``
show the pruned keys with zeros in the dropped channels and ``key_channels`` beside them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from restkv.options import ConfigError, Options, option, register
from restkv.selection import Selection


@register("switch")
@dataclass(frozen=True)
class KeyChannelPruning(Options):
    """ThinK: drop each KV head's least important key channels after selection."""

    name = "think"
    #: the kept keys are not the input keys (dropped channels are zero)
    changes_entries = True
    switch_help = "ThinK: after selection, drop each KV head's least important key channels (decode queries read " \
                  "the kept ones)"

    pruning_ratio: float = option(0.4, "--think: fraction of each KV head's key channels dropped", minimum=0)
    recent_size: int = option(32, "--think: the newest prompt tokens whose keys keep every channel (capped at "
                                  "those every head keeps: --window_size for SnapKV)", minimum=0)

    def validate(self) -> None:
        if self.pruning_ratio >= 1:
            raise ConfigError(f"--pruning_ratio must be a fraction in [0, 1); got {self.pruning_ratio}")

    def check(self, config) -> None:
        policy = config.policy
        if not policy.evicts:
            raise ConfigError(f"--think prunes a compressed layer's keys; --method {policy.name} keeps the native "
                              "cache")
        if config.rescores:
            raise ConfigError("--think prunes key channels once after eviction; --prefill_chunk_size and "
                              "--decode_budget evict again from whole keys (not supported together)")

    def recent_tokens(self, config) -> int:
        """The newest prompt tokens kept whole: ``--recent_size``, capped at those every head keeps
        (the method's protected tokens, at most ``--window_size``: 1 for TOVA, 0 for KVzip)."""
        run = config.run
        budget = run.max_capacity_prompts or run.decode_budget or run.window_size + self.recent_size + 1
        return min(self.recent_size, run.window_size, config.policy.protected_count(run.window_size, budget))

    def pruned_channels(self, head_dim: int) -> int:
        """Key channels each head drops."""
        return int(self.pruning_ratio * head_dim)

    def prune(self, ctx, selection: Selection, recent_size: int) -> Selection:
        """``selection`` with each head's dropped key channels zeroed outside the ``recent_size``
        newest tokens (``recent_tokens``), and ``key_channels`` ``[B, H_kv, d - pruned]``
        (ascending) set; unchanged when nothing is dropped."""
        keys = selection.keys
        dropped = self.pruned_channels(keys.shape[-1])
        if dropped == 0:
            return selection
        held = held_slots(selection)
        pruned = held & ~(selection.columns >= ctx.key.shape[2] - recent_size)
        window = ctx.query[:, :, -max(ctx.window_size, 1) :].float()
        query_power = ctx.reduce_groups(window.pow(2).mean(dim=2), "mean")  # [B, H_kv, d]
        # Every kept entry's energy, the recent tokens' too (ThinK's release: all the kept keys).
        key_power = (keys.float().pow(2) * held[..., None]).sum(dim=2) / held.sum(dim=2, keepdim=True).clamp(min=1)
        importance = query_power * key_power
        # Most important first, ties to the lower channel; the kept ones in ascending order.
        order = torch.sort(importance, dim=-1, descending=True, stable=True).indices
        channels = order[..., : keys.shape[-1] - dropped].sort(dim=-1).values
        kept = torch.zeros_like(keys, dtype=torch.bool).scatter_(
            -1, channels[:, :, None, :].expand(-1, -1, keys.shape[2], -1), True)
        keys = keys.masked_fill(~kept & pruned[..., None], 0)
        return dataclasses.replace(selection, keys=keys, key_channels=channels)


def held_slots(selection: Selection) -> torch.Tensor:
    """``[B, H_kv, S]`` bool: slots that hold an exact token or a residual entry."""
    held = selection.columns >= 0
    if selection.residual_log_counts is not None:
        width = selection.residual_log_counts.shape[-1]
        held[..., held.shape[-1] - width :] |= torch.isfinite(selection.residual_log_counts)
    return held


def split_recent(selection: Selection, tokens_seen: int, recent_size: int,
                 padding: torch.Tensor | None = None) -> tuple[Selection, torch.Tensor, torch.Tensor]:
    """A pruned ``selection`` as a layer stores it: the entries without the recent tokens, keys
    compacted to their ``key_channels``, and the recent tokens' whole keys and values
    ``[B, H_kv, recent_size, d]`` (zeros where a row's prompt is shorter), in position order.

    Every head keeps every real recent token (they are protected; ``padding`` ``[B]``: each
    row's left padding); the others keep their slots, residual entries their place in the last slots.
    """
    keys, values, columns = selection.keys, selection.values, selection.columns
    first = tokens_seen - recent_size
    recent = columns >= first
    real = recent_size - (padding.to(columns.device) - first).clamp(min=0) if padding is not None else recent_size
    if bool((recent.sum(dim=-1) != torch.as_tensor(real, device=columns.device).reshape(-1, 1)).any()):
        raise ConfigError(f"--recent_size {recent_size}: some KV head dropped one of the newest tokens; lower it "
                          "to the tokens the method always keeps")
    batch, heads, width, dim = keys.shape
    # The recent tokens, by position (a spare last slot takes the others).
    where = torch.where(recent, columns - first, recent_size).long()
    recent_keys = keys.new_zeros(batch, heads, recent_size + 1, dim).scatter_(
        2, where[..., None].expand(-1, -1, -1, dim), keys)[:, :, :recent_size]
    recent_values = values.new_zeros(batch, heads, recent_size + 1, values.shape[-1]).scatter_(
        2, where[..., None].expand(-1, -1, -1, values.shape[-1]), values)[:, :, :recent_size]
    # The rest: each head's older exact tokens first, residual entries still in the last slots.
    tail = 0 if selection.residual_log_counts is None else selection.residual_log_counts.shape[-1]
    older = ((columns >= 0) & ~recent).sum(dim=-1)  # [B, H_kv]
    residual = held_slots(selection)[..., width - tail :].sum(dim=-1) if tail else torch.zeros_like(older)
    new_width = int((older + residual).max()) if older.numel() else 0
    new_width = max(new_width, tail)
    slot = torch.arange(new_width, device=keys.device)
    source = torch.where(slot >= new_width - tail, slot + (width - new_width), slot).expand(batch, heads, -1)
    used = (slot < older[..., None]) | (slot >= new_width - tail)
    source = torch.where(used, source, 0)
    compact = keys.gather(-1, selection.key_channels[:, :, None, :].expand(-1, -1, width, -1))
    def slots(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.gather(2, source[..., None].expand(-1, -1, -1, tensor.shape[-1])).masked_fill(~used[..., None], 0)

    rest = dataclasses.replace(selection, keys=slots(compact), values=slots(values),
                               columns=torch.where(used, columns.gather(2, source), -1))  # residual slots: -1
    return rest, recent_keys, recent_values
