"""What a policy is, and what it sees.

A policy scores every prompt token of one layer, per batch row and KV head; selection,
budgets and storage are handled once for all policies (``restkv.selection``,
``restkv.allocation``, ``restkv.cache``). Adding a method = one file with a ``Policy``
subclass decorated with ``@register_policy``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from restkv.adaptive_pooling import adaptive_pool
from restkv.scoring import pool_scores, reduce_groups, window_attention

if TYPE_CHECKING:
    from restkv.config import CompressionConfig


@dataclass
class ScoringContext:
    """One layer's prompt, as every policy sees it.

    Attributes
    ----------
    query: ``[B, H, N, d]`` post-RoPE queries of all prompt tokens.
    key, value: ``[B, H_kv, N, d]``, stored once per KV head.
    valid: ``[B, N]`` bool, real tokens (prompts are left-padded).
    budgets: ``[B]`` tokens each row keeps per KV head (window included).
    protected: ``[B, N]`` bool, tokens kept regardless of score (the recent window).
    scaling, softcap, sliding_window: the layer's attention parameters.
    o_proj_weight: ``[D, H*d]`` output projection (methods that score in output space).
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    valid: torch.Tensor
    budgets: torch.Tensor
    protected: torch.Tensor
    config: "CompressionConfig"
    layer_idx: int
    num_layers: int
    scaling: float
    softcap: float | None = None
    sliding_window: int | None = None
    o_proj_weight: torch.Tensor | None = None
    _window_cache: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_kv_heads(self) -> int:
        return self.key.shape[1]

    @property
    def lengths(self) -> torch.Tensor:
        """``[B]`` real tokens per row."""
        return self.valid.sum(dim=-1)

    @property
    def candidates(self) -> torch.Tensor:
        """``[B, N]`` bool, tokens that compete for the budget (real and not protected)."""
        return self.valid & ~self.protected

    def window_attention(self, num_queries: int | None = None) -> torch.Tensor:
        """``[B, H, w, N]`` float32 attention of the last ``w`` queries (default: the window).

        Computed once per ``w`` and shared by every scorer of the layer.
        """
        w = self.config.window_size if num_queries is None else num_queries
        if w not in self._window_cache:
            self._window_cache[w] = window_attention(
                self.query, self.key, self.valid, w, self.scaling, self.softcap, self.sliding_window
            )
        return self._window_cache[w]

    def reduce_groups(self, scores: torch.Tensor) -> torch.Tensor:
        """Per-query-head ``[B, H, N]`` to per-KV-head ``[B, H_kv, N]`` (``--gqa_score_agg``)."""
        return reduce_groups(scores, self.num_kv_heads, self.config.gqa_score_agg)

    def pool(self, scores: torch.Tensor) -> torch.Tensor:
        """Spatial smoothing with ``--pooling``/``--kernel_size`` over the candidates
        (``adaptive``: ReST-KV's drift-driven kernel, ``restkv.adaptive_pooling``)."""
        if self.config.pooling == "adaptive":
            return adaptive_pool(self, scores)
        return pool_scores(scores, self.candidates, self.config.pooling, self.config.kernel_size)


class Policy:
    """Base class: scores tokens; the shared selection keeps the top ones plus the protected ones."""

    name: ClassVar[str]
    #: whether ``--pooling`` applies (documented per method)
    uses_pooling: ClassVar[bool] = False
    #: the budget allocation the method is defined with (``--method pyramidkv`` = SnapKV + pyramid);
    #: None lets ``--allocation`` choose
    allocation: ClassVar[str | None] = None
    #: the method's own defaults of options left at None (``config.METHOD_DEFAULTS``)
    option_defaults: ClassVar[dict[str, Any]] = {}

    def protected_count(self, config: "CompressionConfig", budget: int) -> int:
        """Most recent tokens always kept, out of a row budget of ``budget`` tokens."""
        return config.window_size

    def compresses_layer(self, config: "CompressionConfig", layer_idx: int) -> bool:
        """False for layers the method leaves untouched."""
        return True

    def validate(self, config: "CompressionConfig") -> None:
        """Reject settings that cannot work, naming the flag (fixed budgets are checked here;
        ratio budgets are checked per row at compression time)."""
        from restkv.config import ConfigError

        budget = config.max_capacity_prompts
        if budget is not None and self.protected_count(config, budget) >= budget:
            raise ConfigError(
                f"--window_size {config.window_size} must be smaller than --max_capacity_prompts {budget} "
                f"(the budget includes the window) for --method {config.method}"
            )

    def score(self, ctx: ScoringContext) -> torch.Tensor:
        """``[B, H_kv, N]`` float32 importance; only candidate columns are read."""
        raise NotImplementedError

    def finalize(
        self, ctx: ScoringContext, indices: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook after selection for methods that also change the kept entries (merging)."""
        return keys, values
