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
masks at decode), which the cache does not have. The release also prunes a layer whose prompt
fits the budget (it evicts nothing); here such a layer stays exact, so a budget at or above the
prompt reproduces the unpatched model as for every method, and ``--prune_fitting_layers`` prunes
it as the release does.

Storage: a ``PrunedKeyTokens`` segment of the compressed layer holds the pruned keys with only
the kept channels (``[B, H_kv, S, d - pruned]``) and their indices per head; a read selects the
query channels that meet them, which is the same as masking the dropped ones. The recent
tokens, whole, open the layer's tail. ``compress_kv`` shows the pruned keys with zeros in the
dropped channels and ``key_channels`` beside them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from restkv.cache.segments.pruned_keys import PrunedKeyTokens
from restkv.config.options import ConfigError, Options, option, register


@register("switch")
@dataclass(frozen=True)
class KeyChannelPruning(Options):
    """ThinK: drop each KV head's least important key channels after selection."""

    name = "think"
    reference = "ThinK: Xu et al., 2024, arXiv 2407.21018"
    #: the kept keys are not the input keys (dropped channels are zero)
    changes_entries = True
    switch_help = "ThinK: after selection, drop each KV head's least important key channels (decode queries read " \
                  "the kept ones)"

    pruning_ratio: float = option(0.4, "--think: fraction of each KV head's key channels dropped", minimum=0)
    recent_size: int = option(32, "--think: the newest prompt tokens whose keys keep every channel (capped at "
                                  "those every head keeps: --window_size for SnapKV)", minimum=0)
    prune_fitting_layers: bool = option(False, "--think: prune the key channels of a layer whose prompt fits the "
                                               "budget too, as ThinK's release does (that layer then differs from "
                                               "the uncompressed model); default: it stays exact")

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

    def exact_recent_tokens(self, config) -> int:
        """The newest prompt tokens kept whole: ``--recent_size``, capped at those every head keeps
        (the method's protected tokens, at most ``--window_size``: 1 for TOVA, 0 for KVzip)."""
        run = config.run
        budget = run.max_capacity_prompts or run.decode_budget or run.window_size + self.recent_size + 1
        return min(self.recent_size, run.window_size, config.policy.protected_count(run.window_size, budget))

    def pruned_channels(self, head_dim: int) -> int:
        """Key channels each head drops."""
        return int(self.pruning_ratio * head_dim)

    def storing(self, ctx, keys: torch.Tensor, columns: torch.Tensor):
        """The older tokens with each head's chosen channels of their keys, wrapping how the storage parts before
        store them (``restkv.pipeline.compress.TokenStorage``); None when no channel is dropped."""
        channels = self.choose_channels(ctx, keys, columns)
        return None if channels is None else partial(_pruned, channels)

    def choose_channels(self, ctx, keys: torch.Tensor, columns: torch.Tensor) -> torch.Tensor | None:
        """``[B, H_kv, d - pruned]`` the key channels each head keeps (ascending), scored over every
        kept token ``keys`` ``[B, H_kv, K, d]`` at ``columns`` (-1 = unused), the recent ones too;
        None when nothing is dropped."""
        dropped = self.pruned_channels(keys.shape[-1])
        if dropped == 0:
            return None
        held = columns >= 0
        window = ctx.query[:, :, -max(ctx.window_size, 1) :].float()
        query_power = ctx.reduce_groups(window.pow(2).mean(dim=2), "mean")  # [B, H_kv, d]
        # Every kept entry's energy, the recent tokens' too (ThinK's release: all the kept keys).
        key_power = (keys.float().pow(2) * held[..., None]).sum(dim=2) / held.sum(dim=2, keepdim=True).clamp(min=1)
        importance = query_power * key_power
        # Most important first, ties to the lower channel; the kept ones in ascending order.
        order = torch.sort(importance, dim=-1, descending=True, stable=True).indices
        return order[..., : keys.shape[-1] - dropped].sort(dim=-1).values


def _pruned(channels: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor,
            inner) -> PrunedKeyTokens:
    """``keys`` ``[B, H_kv, S, d]`` cut to ``channels`` ``[B, H_kv, c]``, stored by ``inner`` with the values."""
    compact = keys.gather(-1, channels[:, :, None, :].expand(-1, -1, keys.shape[2], -1))
    return PrunedKeyTokens(inner(compact, values, columns), channels, keys.shape[-1])
