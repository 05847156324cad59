"""What a policy is: a scorer that owns its options.

A policy is a frozen dataclass whose fields are its options (``restkv.config.options.option``:
the field name is the flag, with its help, type and range). ``score(ctx)`` returns an
importance per batch row, KV head and token; selection, budgets and storage are shared by
every policy (``restkv.scoring.selection``, ``restkv.allocations``, ``restkv.cache``). What a policy
can do is declared on the class (``evicts``, ``ranks_by_position``, ``observes_queries``, the
allocation, merge or switches it is defined with), never inferred from its name. That is the whole
contract of a method: it scores. Summarising what is evicted, merging it, storing it another way belong
to their own parts (switches, merges, quantisers); a method that also summarises (IndexMem) implements
the summariser's ``reserve`` and ``summarise`` (``restkv.pipeline.compress.Summariser``) beside ``score``.

Adding a method = one file in ``restkv/policies/`` with a ``Policy`` subclass decorated with
``@register("method")`` (see ``docs/ARCHITECTURE.md``)::

    @register("method")
    @dataclass(frozen=True)
    class KeyNorm(Policy):
        name = "keynorm"
        keynorm_power: float = option(1.0, "exponent of the key norm", minimum=0)

        def score(self, ctx):
            return -ctx.key.float().norm(dim=-1) ** self.keynorm_power
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from restkv.config.composition import RECONSTRUCTION_CHUNK
from restkv.config.options import ConfigError, Options, option
from restkv.pipeline.inputs import LayerInputs
from restkv.scoring.adaptive_pooling import adaptive_pool

if TYPE_CHECKING:
    from restkv.config import CompressionConfig

POOLINGS = ("none", "avgpool", "maxpool", "adaptive")
GQA_AGGREGATIONS = ("mean", "max", "sum")


@dataclass(frozen=True)
class Policy(Options):
    """Base class: scores tokens; the shared selection keeps the top ones plus the protected ones."""

    name: ClassVar[str]
    #: False for a method that keeps every token (``fullkv``): it needs no budget
    evicts: ClassVar[bool] = True
    #: keeps tokens by position, not by a ranking (StreamingLLM): a ranking cannot be split
    ranks_by_position: ClassVar[bool] = False
    #: the allocation the method is defined with (``pyramidkv`` = SnapKV + pyramid); None lets
    #: ``--allocation`` choose
    allocation: ClassVar[str | None] = None
    #: the merge the method is defined with (``cam`` = its scores + ``--merge cam``); None lets ``--merge`` choose
    own_merge: ClassVar[str | None] = None
    #: for a method with its own allocation or switches: the method whose scores it uses
    base_method: ClassVar[str | None] = None
    #: scores with the attention of observation queries (so ``--observation`` chooses them)
    observes_queries: ClassVar[bool] = True
    #: the observation the method is defined with (``--observation`` overrides it)
    default_observation: ClassVar[str] = "window"
    #: under ``--observation reconstruction``, the repetition follows the reconstruction prompt's
    #: instruction (KVzip's); False: the bare context is repeated (KVCompose's replay)
    repeats_with_instruction: ClassVar[bool] = True
    #: under ``--observation reconstruction``, the context tokens one repetition forward reads unless
    #: ``--reconstruction_chunk`` says (None: the whole context at once)
    default_reconstruction_chunk: ClassVar[int | None] = RECONSTRUCTION_CHUNK
    #: under ``--observation reconstruction``, each reconstruction query's attention is weighted by
    #: the gradient norm of the last hidden states at its attention output (KVgrad,
    #: ``restkv.integrations.transformers.replay_gradients``)
    weights_by_gradient: ClassVar[bool] = False
    #: switches the method is defined with (``think`` = SnapKV with ``--think``, ``momentkv`` =
    #: SnapKV with ``--moments``)
    own_switches: ClassVar[tuple[str, ...]] = ()
    #: scores with weights fitted to one model's layers and heads (``learned_zip``, ``kvzap``), so it cannot
    #: score a layer of any other shape
    fitted_to_a_model: ClassVar[bool] = False
    #: ranks the context alone as KVzip does without reading reconstruction queries (``learned_zip``): the
    #: template around a given context span is kept whatever its score
    #: (``restkv.integrations.transformers.context_span``)
    ranks_context_alone: ClassVar[bool] = False
    #: reads the RoPE tables the keys were rotated with (``LayerInputs.rotary``): keys or queries
    #: before RoPE, or rotations to other positions; ``compress_kv`` needs its ``rotary`` then
    needs_rotary: ClassVar[bool] = False
    #: reads the attention's input at every key (``LayerInputs.hidden``: KVzap); ``compress_kv``
    #: needs its ``hidden_states`` then, and held tokens (chunked prefill, decode budgets) cannot give them
    needs_hidden_states: ClassVar[bool] = False
    #: a token's score depends on that token alone (its key, value or hidden state), so it is computed once as the
    #: token comes and ranked later beside newer tokens': what lets scorers of hidden states or of keys before
    #: RoPE compress during generation (``restkv.integrations.transformers.steps.compress_again``)
    scores_each_token_alone: ClassVar[bool] = False
    #: asks for a step between its scoring and the eviction, after the whole prefill (RestoreKV's restore pass):
    #: ``before_eviction(decoder, layers, forward) -> {layer: [summary segments]}``, ``forward(embeddings)`` the
    #: K/V of embeddings run after the uncompressed context (``restkv.integrations.transformers.deferred``)
    steps_before_eviction: ClassVar[bool] = False

    @property
    def reads_every_query(self) -> bool:
        """True when scoring reads the query of every prompt token, not only the trailing window's: what
        an engine that keeps only the last queries of a prompt (vLLM's) cannot give."""
        return False

    @property
    def question_delimiter(self) -> int | None:
        """The token id that splits a prompt into context and question, where the method finds its window so
        (Finch's ``--finch_delimiter``): the question's tokens are the observation window, and the token is
        taken out before the model runs (``restkv.integrations.transformers.question_window``); None: the
        window is ``--window_size``."""
        return None

    @property
    def divides_by_hidden_norm(self) -> bool:
        """Whether each reconstruction query's attention is divided by its hidden state's norm
        before it is folded into the statistics (KVzip+)."""
        return False

    def pre_rope_flags(self) -> list[str]:
        return [f"--method {self.name}"] if self.needs_rotary else []

    def for_run(self, run: Any) -> "Policy":
        """The policy with the defaults that follow the run's options (``RunOptions``) filled in;
        itself for most methods."""
        return self

    def own_allocation(self) -> str | None:
        """The allocation the method is defined with (``allocation``, unless one of its options
        chooses, like ``--kvzip_layerwise``); None lets ``--allocation`` choose."""
        return self.allocation

    @property
    def reads_attention_drift(self) -> bool:
        """True when scoring reads ReST-KV's drift statistic (``ObservedLayer.shift_positions``)."""
        return False

    @property
    def shares_scores_across_heads(self) -> bool:
        """True when every KV head of a layer keeps the same tokens (one score for the layer)."""
        return False

    def protected_count(self, window_size: int, budget: int) -> int:
        """Most recent tokens always kept, out of a row budget of ``budget`` tokens."""
        return window_size

    def always_kept(self, window_size: int) -> str:
        """What the method keeps whatever the budget, as the flag that sets it (for messages)."""
        return f"--window_size {window_size} (the newest tokens are always kept)"

    def compresses_layer(self, layer_idx: int) -> bool:
        """False for layers the method leaves untouched."""
        return True

    def check(self, config: "CompressionConfig") -> None:
        """A fixed budget must exceed the protected tokens (ratio budgets are checked per row); a
        scorer of hidden states cannot score held tokens again."""
        budget = config.run.max_capacity_prompts
        if self.evicts and budget is not None and self.protected_count(config.run.window_size, budget) >= budget:
            raise ConfigError(
                f"--window_size {config.run.window_size} must be smaller than --max_capacity_prompts {budget} "
                f"(the budget includes the window) for --method {self.name}"
            )
        # Generation is served by scores taken as each token comes; a later chunk's compression is not.
        flags = [flag for flag in config.rescoring_flags()
                 if not (self.scores_each_token_alone and not flag.startswith("--prefill_chunk_size"))]
        if self.needs_hidden_states and flags:
            raise ConfigError(f"--method {self.name} scores the hidden states of the prompt's tokens; "
                              f"{' and '.join(flags)} compress tokens whose hidden states are no longer kept")

    def compressible_to(self, window_size: int, budget: int) -> bool:
        """Whether a row can be compressed to ``budget`` tokens: more than it always keeps."""
        return self.protected_count(window_size, budget) < budget

    def check_row(self, config: "CompressionConfig", length: int, budget: int, protected: int) -> None:
        """A row that is compressed must keep more than its protected tokens."""
        if protected >= budget:
            raise ConfigError(
                f"a row of {length} tokens keeps {budget} tokens (--compression_ratio "
                f"{config.run.compression_ratio}), which does not exceed the {protected} protected tokens "
                f"(--window_size {config.run.window_size}); lower the ratio or the window"
            )

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        """``[B, H_kv, N]`` float32 importance; only candidate columns are read."""
        raise NotImplementedError



def require_ranking(flag: str, policy: Policy) -> None:
    """Refuse (``ConfigError``) a part ``flag`` that works on a scorer's ranking for a method that
    has none: it keeps every token, or keeps tokens by position."""
    if not policy.evicts or policy.ranks_by_position:
        raise ConfigError(f"{flag} works on a scorer's ranking; --method {policy.name} "
                          f"{'evicts nothing' if not policy.evicts else 'keeps tokens by position'}")


@dataclass(frozen=True)
class GroupedScores(Policy):
    """A scorer whose per-query-head scores are reduced to one per KV head."""

    gqa_score_agg: str = option("mean", "how a query group's scores are reduced to one per KV head",
                                GQA_AGGREGATIONS)

    def reduce(self, ctx: LayerInputs, scores: torch.Tensor) -> torch.Tensor:
        """``[B, H, N]`` per query head to ``[B, H_kv, N]`` (``--gqa_score_agg``)."""
        return ctx.reduce_groups(scores, self.gqa_score_agg)


@dataclass(frozen=True)
class SinkOptions(Options):
    """The attention sinks a policy keeps whatever their score (``--n_sink``, declared once here)."""

    n_sink: int = option(4, "the first tokens, always kept (attention sinks)", minimum=0)

    def sinks_among(self, ctx, row: int, count: int) -> int:
        """How many of row ``row``'s sinks are among its last ``count`` tokens (the visible ones a
        row-local scorer reads: all of them unless a sliding window hides the first)."""
        return max(self.n_sink - (int(ctx.plan.lengths[row]) - count), 0)


@dataclass(frozen=True)
class KeepsSinks(SinkOptions):
    """For a policy whose first ``n_sink`` tokens are always kept: the sinks must leave room in the
    budget (else they fill it, and a model-wide ranking gives their ties to the first layers,
    leaving later ones empty)."""

    def check_sinks(self, config: "CompressionConfig") -> None:
        budget = config.run.max_capacity_prompts
        if budget is not None and self.n_sink >= budget:
            raise ConfigError(f"--n_sink {self.n_sink} must be smaller than --max_capacity_prompts {budget} (the "
                              "first --n_sink tokens are always kept)")

    def compressible_to(self, window_size: int, budget: int) -> bool:
        return self.n_sink < budget

    def always_kept(self, window_size: int) -> str:
        return f"--n_sink {self.n_sink} (the first --n_sink tokens are always kept)"

    def mark_sinks(self, ctx, scores: torch.Tensor, score: float) -> torch.Tensor:
        """``scores`` with ``score`` at each row's first ``n_sink`` tokens, found by their row-local
        positions (a chunk scored after the first holds none of them)."""
        columns = torch.arange(scores.shape[-1], device=scores.device).expand(*scores.shape[:2], -1)
        local = ctx.positions_of(columns).long() - ctx.row_padding.to(scores.device).view(-1, 1, 1)
        return scores.masked_fill((local >= 0) & (local < self.n_sink), score)

    def check_row(self, config: "CompressionConfig", length: int, budget: int, protected: int) -> None:
        if not self.compressible_to(config.run.window_size, budget):
            raise ConfigError(
                f"a row of {length} tokens keeps {budget} tokens (--compression_ratio "
                f"{config.run.compression_ratio}), which does not exceed {self.always_kept(config.run.window_size)}"
            )


POOLING_HELP = "spatial smoothing of the scores (adaptive: ReST-KV's drift-driven kernel)"


@dataclass(frozen=True)
class PooledScores(GroupedScores):
    """A grouped scorer whose per-KV-head scores are smoothed along positions (``--pooling``)."""

    pooling: str = option("avgpool", POOLING_HELP, POOLINGS)
    kernel_size: int = option(5, "odd kernel of the spatial smoothing (the smallest one under adaptive)",
                              minimum=1)
    scale: float = option(2000.0, "adaptive pooling: tokens of attention drift per extra kernel step and shift",
                          minimum=0, exclusive_minimum=True)

    def validate(self) -> None:
        if self.kernel_size % 2 == 0:
            raise ConfigError(f"--kernel_size must be odd (got {self.kernel_size}); an even kernel shifts the scores")
        if self.pooling == "adaptive" and self.kernel_size < 3:
            raise ConfigError(
                f"--pooling adaptive needs an odd --kernel_size >= 3 (its smallest kernel); got {self.kernel_size}"
            )

    def check(self, config: "CompressionConfig") -> None:
        super().check(config)
        if self.pooling == "adaptive" and config.run.window_size < 2:
            raise ConfigError(
                f"--pooling adaptive compares the two halves of the window, so it needs --window_size >= 2; "
                f"got {config.run.window_size}"
            )

    @property
    def reads_attention_drift(self) -> bool:
        return self.pooling == "adaptive"

    def smooth(self, ctx: LayerInputs, scores: torch.Tensor) -> torch.Tensor:
        """Spatial smoothing with ``--pooling``/``--kernel_size`` over the candidates
        (``adaptive``: ReST-KV's drift-driven kernel, ``restkv.scoring.adaptive_pooling``)."""
        if self.pooling == "adaptive":
            return adaptive_pool(ctx, scores, self.scale, self.kernel_size)
        return ctx.pool(scores, self.pooling, self.kernel_size)


def check_weights_fit(flag: str, path: str, what: str, layers: int, heads: int, model) -> None:
    """Refuse (naming ``flag``) a weights file of ``layers`` ``what`` of ``heads`` KV heads each for a
    model (``ModelShape``) of another shape."""
    if (layers, heads) != (model.num_layers, model.num_kv_heads):
        raise ConfigError(f"{flag} {path} holds {layers} {what} of {heads} KV heads; the model has "
                          f"{model.num_layers} layers of {model.num_kv_heads}")


def layer_weights(flag: str, path: str, what: str, per_layer: list, layer_idx: int):
    """The entry of ``per_layer`` for layer ``layer_idx``, or a one-line error naming ``flag``."""
    if layer_idx >= len(per_layer):
        raise ConfigError(f"{flag} {path} holds {len(per_layer)} {what}; layer {layer_idx} has none")
    return per_layer[layer_idx]

