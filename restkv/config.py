"""One validated dataclass holding every compression knob.

Budget semantics (as in the original ReST-KV release): ``max_capacity_prompts`` is the
number of tokens each layer keeps **per KV head**, observation window included. The
alternative ``compression_ratio`` is the fraction of the prompt that is removed, so a row
of ``L`` real tokens keeps ``floor(L * (1 - compression_ratio))`` tokens.

Every error raised here names the flag and the allowed values, so a typo in a sweep
script fails at construction instead of producing a silently different run.

Per-method defaults: an option whose default is None in ``METHOD_DEFAULTS`` (``pooling``)
takes the method's own value (``Policy.option_defaults``: adaptive for restkv, avgpool
otherwise), and ``temporal`` left at None follows ``--use_ema`` (ema or mean). They are
resolved once, at construction, so the config always holds the values a run uses;
``replace`` resolves them again, so switching ``method`` or ``use_ema`` updates them while
explicitly given values stay. ReST-KV's own options default to the paper's flags.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

POOLINGS = ("none", "avgpool", "maxpool", "adaptive")
GQA_AGGREGATIONS = ("mean", "max", "sum")
H2O_QUERIES = ("window", "all")
ALLOCATIONS = ("uniform", "pyramid", "adakv", "headkv")
MERGES = ("none", "pivot")
CAM_MODES = ("paper", "reference")
METRIC_MODES = ("after", "before")
MEAN_OUTPUTS = ("past_only", "full")
RESTKV_GQA = ("mean", "vector")
INDICATORS = ("reconstruction", "attn", "attn_v", "random")
TEMPORAL_MODES = ("none", "mean", "ema", "inv_ema")
RESIDUAL_SELECT_ON = ("fit", "validation")
RESIDUAL_EMPTY = ("drop", "reseed")
#: Options whose default (None) is the method's own value (``Policy.option_defaults``), else
#: the library value given here. ``temporal`` (None) follows ``--use_ema`` instead.
METHOD_DEFAULTS = {"pooling": "avgpool"}


class ConfigError(ValueError):
    """A compression setting is invalid; the message names the flag and the allowed values."""


def option(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A config field with its command-line help (runners build their flags from these)."""
    metadata = {"help": help}
    if choices is not None:
        metadata["choices"] = choices
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class CompressionConfig:
    """Every knob of a compression run; each field's ``metadata["help"]`` says what it does.

    The runners expose every field as ``--<name>``, so the field names are the public flag
    names (those of the original ReST-KV release where it had them).
    """

    method: str = option("snapkv", "compression method (see restkv.available_methods())")
    max_capacity_prompts: int | None = option(
        None, "tokens kept per layer and KV head, observation window included"
    )
    compression_ratio: float | None = option(
        None, "fraction of each row's prompt that is removed, in (0, 1); exclusive with --max_capacity_prompts"
    )
    window_size: int = option(32, "observation window: the last tokens that score the rest and are always kept")
    kernel_size: int = option(5, "odd kernel of the spatial smoothing of the scores")
    pooling: str | None = option(
        None,
        "spatial smoothing of the scores; default: the method's own (adaptive for restkv, avgpool otherwise)",
        POOLINGS,
    )
    gqa_score_agg: str = option("mean", "how a query group's scores are reduced to one per KV head", GQA_AGGREGATIONS)
    n_sink: int = option(
        4, "StreamingLLM attention sinks (max_capacity_prompts - window_size reproduces the original release)"
    )
    l2norm_skip_layers: tuple[int, ...] = option((0, 1), "layers L2Norm leaves uncompressed")
    l2norm_protect_window: bool = option(False, "L2Norm also keeps the observation window")
    h2o_queries: str = option(
        "window", "H2O accumulates the attention of the observation window or of all prompt queries", H2O_QUERIES
    )
    h2o_normalize: bool = option(False, "H2O divides each token's sum by the number of queries that see it")
    tova_per_head: bool = option(False, "TOVA averages the last query's attention per query group, not per layer")
    seed: int = option(0, "seed of the random control policy")
    allocation: str | None = option(
        None,
        "how the budget is spread over layers and KV heads; default: the method's own (pyramid for pyramidkv, "
        "adakv for adakv, headkv for headkv, uniform for the rest)",
        ALLOCATIONS,
    )
    use_pyramid: bool = option(
        False, "the original release's flag: PyramidKV's layer schedule without its middle (uniform) regime"
    )
    pyramid_beta: int = option(20, "PyramidKV: the last layer keeps about budget / beta candidate tokens")
    pyramid_reference_rounding: bool = option(
        False, "PyramidKV: floor the per-layer step as the original release does (overshoots the total budget)"
    )
    floor: float = option(0.2, "AdaKV safeguard: every head keeps at least floor * (budget - window) candidates")
    adakv_reference_allocation: bool = option(
        False, "AdaKV: the original rounding (head totals off by a few tokens, floor approximate)"
    )
    adakv_normalize: bool = option(
        True, "AdaKV: weight each head's scores by the share of its mass in its own top budget before ranking"
    )
    head_scores: str | None = option(
        None, "HeadKV: JSON file of per-head importance scores (python -m restkv.head_scores computes one)"
    )
    head_beta: float = option(1.01, "HeadKV: budget / head_beta candidates per head are pooled and redistributed")
    head_temp: float = option(1.0, "HeadKV: temperature applied to the normalised head scores")
    headkv_window_outside: bool = option(
        False, "HeadKV: the reference runner's semantics, window kept on top of the head capacity"
    )
    merge: str = option("none", "merge evicted tokens into kept ones after selection (LOOK-M pivot)", MERGES)
    cam_mode: str = option("paper", "CaM: the paper's merge after selection, or the release's cascade", CAM_MODES)
    cam_seed: int = option(0, "CaM: seed of the Bernoulli merge decisions")
    cam_expected: bool = option(False, "CaM: merge with the probability itself instead of a Bernoulli draw")
    cam_merge_tokens: int = option(32, "CaM (paper mode): kept tokens after an evicted one that share its value")
    use_wo: bool = option(
        True, "ReST-KV: measure the output change through the layer's W_o (--no-use_wo: in value space, without --tau)"
    )
    use_ema: bool = option(
        True, "ReST-KV: aggregate the window queries with an EMA of weight --alpha (--no-use_ema: their mean)"
    )
    alpha: float = option(0.3, "ReST-KV: EMA weight of the newest window query, in [0, 1]")
    metric_mode: str = option(
        "after",
        "ReST-KV: 'after' aggregates the window attention, then scores once (the paper); 'before' scores every "
        "window query, then aggregates",
        METRIC_MODES,
    )
    scale: float = option(2000.0, "ReST-KV adaptive pooling: tokens of attention drift per extra kernel step and shift")
    tau: float = option(1.0, "ReST-KV: exponent of the output-space gap (--use_wo with --metric_mode after), > 0")
    use_norm: bool = option(
        False, "ReST-KV --metric_mode before: divide each query's term by its output norm (after mode ignores it)"
    )
    restkv_mean_output: str = option(
        "past_only",
        "ReST-KV after mode: the mean output mixes the past values only (the release) or every value",
        MEAN_OUTPUTS,
    )
    restkv_gqa: str = option(
        "mean",
        "ReST-KV under GQA: reduce per-query-head scores with --gqa_score_agg, or score the norm of the query "
        "group's summed output change (vector)",
        RESTKV_GQA,
    )
    indicator: str = option(
        "reconstruction",
        "ReST-KV ablation: token importance from the output reconstruction, the window attention (attn), attention "
        "times value norm (attn_v) or random scores",
        INDICATORS,
    )
    temporal: str | None = option(
        None, "ReST-KV ablation: aggregation over the window queries; default: ema with --use_ema, else mean",
        TEMPORAL_MODES,
    )
    residual: bool = option(
        False, "ResKV: give part of each budget to residual entries (k-means summaries of the evicted tokens)"
    )
    residual_ratios: tuple[float, ...] = option(
        (0.0, 0.05, 0.10, 0.15, 0.20), "ResKV: candidate fractions of each budget given to residual entries"
    )
    residual_obs_queries: int = option(128, "ResKV validation: observation queries (the last prompt positions)")
    residual_val_queries: int = option(32, "ResKV validation: how many of the observation queries validate")
    residual_val_split: str = option(
        "interleave", "ResKV validation: which observation queries validate: interleave, last or random:<seed>"
    )
    residual_val_causal: bool = option(
        False, "ResKV validation: each observation query sees only the keys before it (default: every key)"
    )
    residual_val_gate: bool = option(True, "ResKV validation: include the dynamic gate in the validated output")
    residual_select_on: str = option(
        "fit", "ResKV validation: choose the ratio on the fit queries (then accept on validation) or on validation",
        RESIDUAL_SELECT_ON,
    )
    residual_delta: float = option(
        0.01, "ResKV validation: least relative improvement over the pure main cache to keep residual entries"
    )
    residual_no_validation: bool = option(False, "ResKV ablation: --residual_fixed_ratio for every layer and head")
    residual_fixed_ratio: float = option(0.10, "ResKV: the ratio used with --residual_no_validation")
    residual_iters: int = option(4, "ResKV: Lloyd k-means iterations")
    residual_empty: str = option(
        "drop", "ResKV: a k-means cluster that loses its members is dropped or reseeded", RESIDUAL_EMPTY
    )
    residual_beta: float = option(1.0, "ResKV: exponent of the member count in the residual logit (beta log c)")
    residual_gate_tau: float = option(0.25, "ResKV gate: main-cache attention peak at which the gate is 1/2")
    residual_gate_alpha: float = option(12.0, "ResKV gate: slope (1 / temperature)")
    residual_gate_min: float = option(0.0, "ResKV gate: floor, in [0, 1]")
    residual_no_gate: bool = option(False, "ResKV ablation: no dynamic gate (g = 1)")
    residual_separate_softmax: bool = option(
        False, "ResKV ablation: normalise main and residual entries apart and mix the two outputs"
    )

    def __post_init__(self) -> None:
        from restkv.policies import available_methods, get_policy

        if self.method not in available_methods():
            raise ConfigError(
                f"--method {self.method!r} is not a known method; choose one of {', '.join(available_methods())}"
            )
        object.__setattr__(self, "l2norm_skip_layers", tuple(int(i) for i in self.l2norm_skip_layers))
        self._derive_defaults(get_policy(self.method))
        self._check_budget()
        _require_int(self.window_size, "window_size", minimum=0)
        _require_int(self.kernel_size, "kernel_size", minimum=1)
        if self.kernel_size % 2 == 0:
            raise ConfigError(f"--kernel_size must be odd (got {self.kernel_size}); an even kernel shifts the scores")
        _require_choice(self.pooling, "pooling", POOLINGS)
        _require_choice(self.gqa_score_agg, "gqa_score_agg", GQA_AGGREGATIONS)
        _require_choice(self.h2o_queries, "h2o_queries", H2O_QUERIES)
        _require_int(self.n_sink, "n_sink", minimum=0)
        _check_allocation_and_merging(self)
        _check_restkv(self)
        _check_residual(self)
        get_policy(self.method).validate(self)

    def _derive_defaults(self, policy) -> None:
        """Fill the options left at None (see ``METHOD_DEFAULTS``) and remember which, so that
        ``replace`` derives them again for a new method or ``--use_ema``."""
        derived = set()
        for name, library_default in METHOD_DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, policy.option_defaults.get(name, library_default))
                derived.add(name)
        if self.temporal is None:
            object.__setattr__(self, "temporal", "ema" if self.use_ema else "mean")
            derived.add("temporal")
        object.__setattr__(self, "_derived_options", frozenset(derived))

    def _check_budget(self) -> None:
        if self.method == "fullkv":
            return
        if self.max_capacity_prompts is not None and self.compression_ratio is not None:
            raise ConfigError("set either --max_capacity_prompts or --compression_ratio, not both")
        if self.max_capacity_prompts is None and self.compression_ratio is None:
            raise ConfigError(
                f"--method {self.method} needs a budget: --max_capacity_prompts N (tokens per layer and KV head, "
                "window included) or --compression_ratio R in (0, 1)"
            )
        if self.max_capacity_prompts is not None:
            _require_int(self.max_capacity_prompts, "max_capacity_prompts", minimum=1)
        else:
            ratio = self.compression_ratio
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio < 1.0:
                raise ConfigError(f"--compression_ratio must lie in the open interval (0, 1); got {ratio!r}")

    # ------------------------------------------------------------------ helpers
    @classmethod
    def from_any(cls, config: "CompressionConfig | Mapping[str, Any]") -> "CompressionConfig":
        """Accept a config or a dict of the same field names (the original release's flag names)."""
        if isinstance(config, CompressionConfig):
            return config
        if not isinstance(config, Mapping):
            raise ConfigError(f"expected a CompressionConfig or a dict of its fields, got {type(config).__name__}")
        return cls.from_options(**config)

    @classmethod
    def from_options(cls, **options: Any) -> "CompressionConfig":
        """Build a config from keyword options; unknown names are rejected with the list of known ones."""
        known = option_names()
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ConfigError(f"unknown option(s) {', '.join(unknown)}; known options: {', '.join(known)}")
        return cls(**options)

    def replace(self, **changes: Any) -> "CompressionConfig":
        """A copy with some options changed (validated again); derived defaults are derived again."""
        explicit = {name: value for name, value in self.to_dict().items() if name not in self._derived_options}
        return CompressionConfig.from_options(**{**explicit, **changes})

    def budget_for(self, length: int) -> int:
        """Tokens kept per KV head for a row of ``length`` real tokens (never more than the row has)."""
        if self.method == "fullkv":
            return length
        if self.max_capacity_prompts is not None:
            return min(self.max_capacity_prompts, length)
        # Round away float noise first: 1000 * (1 - 0.9) is 99.99999999999997, which must keep 100.
        kept = math.floor(round(length * (1.0 - float(self.compression_ratio)), 9))
        return min(kept, length)

    def to_dict(self) -> dict[str, Any]:
        """Flat dict of every option, for run metadata."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def option_names() -> list[str]:
    """Every option name ``CompressionConfig`` accepts."""
    return [f.name for f in dataclasses.fields(CompressionConfig)]


def method_spec_options(spec: str) -> dict[str, Any]:
    """``snapkv+residual`` -> ``{"method": "snapkv", "residual": True}``: a method with boolean
    switches, the short form the sweep and benchmark scripts take for a variant."""
    method, *switches = spec.split("+")
    booleans = {f.name for f in dataclasses.fields(CompressionConfig) if f.type in (bool, "bool")}
    for switch in switches:
        if switch not in booleans:
            raise ConfigError(f"{spec!r}: {switch!r} is not a boolean option; use METHOD or METHOD+SWITCH with "
                              f"SWITCH one of {', '.join(sorted(booleans))}")
    return {"method": method, **{switch: True for switch in switches}}


def _require_int(value: Any, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"--{name} must be an integer >= {minimum}; got {value!r}")
    if value < minimum:
        raise ConfigError(f"--{name} must be >= {minimum}; got {value}")


def _require_finite(config: CompressionConfig, *names: str) -> None:
    """Numeric options must be real finite numbers (not bools, strings, inf or NaN)."""
    for name in names:
        value = getattr(config, name)
        if not (_is_number(value) and math.isfinite(value)):
            raise ConfigError(f"--{name} must be a finite number; got {value!r}")


def _require_bool(config: CompressionConfig, *names: str) -> None:
    """Switches must be real booleans (a string "False" would silently count as true)."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, bool):
            raise ConfigError(f"--{name} must be a boolean (--{name} / --no-{name}); got {value!r}")


def _require_choice(value: Any, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"--{name} {value!r} is not allowed; choose one of {', '.join(choices)}")


def _check_allocation_and_merging(config: CompressionConfig) -> None:
    """Allocation, merging and CaM options (the method-specific checks live in the policies)."""
    from restkv.policies import get_policy

    if config.allocation is not None:
        _require_choice(config.allocation, "allocation", ALLOCATIONS)
    own = get_policy(config.method).allocation
    if own is not None and config.allocation not in (None, own):
        raise ConfigError(
            f"--method {config.method} is SnapKV scores with {own} allocation; for another allocation use "
            f"--method snapkv --allocation {config.allocation}"
        )
    if config.use_pyramid and (own or config.allocation) not in (None, "pyramid"):
        raise ConfigError(f"--use_pyramid selects the pyramid allocation; it cannot be combined with "
                          f"{own or config.allocation}")
    _require_int(config.pyramid_beta, "pyramid_beta", minimum=1)
    _require_finite(config, "floor", "head_beta", "head_temp")
    if not 0.0 <= config.floor <= 1.0:
        raise ConfigError(f"--floor must lie in [0, 1] (a fraction of each head's budget); got {config.floor}")
    if config.head_beta < 1.0:
        raise ConfigError(
            f"--head_beta must be >= 1 (budget / head_beta tokens per head are pooled); got {config.head_beta}"
        )
    if config.head_temp <= 0.0:
        raise ConfigError(f"--head_temp must be > 0; got {config.head_temp}")
    if config.head_scores is not None:
        if not isinstance(config.head_scores, (str, os.PathLike)):
            raise ConfigError(f"--head_scores must be a file path; got {config.head_scores!r}")
        object.__setattr__(config, "head_scores", os.fspath(config.head_scores))
    if (own or config.allocation) == "headkv":
        if config.head_scores is None:
            raise ConfigError(
                "HeadKV allocation needs --head_scores FILE (per-head scores; compute one with python -m "
                "restkv.head_scores --model_path MODEL --out data/heads_score/MODEL_retrieval_reasoning_heads.json)"
            )
        if not os.path.isfile(config.head_scores):
            raise ConfigError(f"--head_scores {config.head_scores!r} is not a file")
    _require_choice(config.merge, "merge", MERGES)
    _require_choice(config.cam_mode, "cam_mode", CAM_MODES)
    _require_int(config.cam_seed, "cam_seed", minimum=0)
    _require_int(config.cam_merge_tokens, "cam_merge_tokens", minimum=1)


def _check_restkv(config: CompressionConfig) -> None:
    """ReST-KV's options (checked for every method, so a bad value never waits for a restkv run)."""
    _require_bool(config, "use_wo", "use_ema", "use_norm")
    _require_finite(config, "alpha", "scale", "tau")
    if not 0.0 <= config.alpha <= 1.0:
        raise ConfigError(f"--alpha must lie in [0, 1] (the EMA weight of the newest window query); got {config.alpha}")
    if config.scale <= 0:
        raise ConfigError(f"--scale must be > 0 (tokens of attention drift per kernel step); got {config.scale}")
    if config.tau <= 0:
        raise ConfigError(f"--tau must be > 0; got {config.tau}")
    _require_choice(config.metric_mode, "metric_mode", METRIC_MODES)
    _require_choice(config.restkv_mean_output, "restkv_mean_output", MEAN_OUTPUTS)
    _require_choice(config.restkv_gqa, "restkv_gqa", RESTKV_GQA)
    _require_choice(config.indicator, "indicator", INDICATORS)
    _require_choice(config.temporal, "temporal", TEMPORAL_MODES)
    if config.pooling == "adaptive" and config.kernel_size < 3:
        raise ConfigError(
            f"--pooling adaptive needs an odd --kernel_size >= 3 (its smallest kernel); got {config.kernel_size}"
        )
    if config.pooling == "adaptive" and config.window_size < 2:
        raise ConfigError(
            f"--pooling adaptive compares the two halves of the window, so it needs --window_size >= 2; "
            f"got {config.window_size}"
        )


def _check_residual(config: CompressionConfig) -> None:
    """ResKV's options (checked for every method, like ReST-KV's)."""
    _require_bool(config, "residual", "residual_val_causal", "residual_val_gate", "residual_no_validation",
                  "residual_no_gate", "residual_separate_softmax")
    ratios = config.residual_ratios
    if isinstance(ratios, (int, float)) or not all(_is_number(r) and 0.0 <= r < 1.0 for r in ratios) or not ratios:
        raise ConfigError(f"--residual_ratios must be one or more fractions in [0, 1); got {ratios!r}")
    object.__setattr__(config, "residual_ratios", tuple(sorted({float(r) for r in ratios})))
    if not (_is_number(config.residual_fixed_ratio) and 0.0 <= config.residual_fixed_ratio < 1.0):
        raise ConfigError(f"--residual_fixed_ratio must be a fraction in [0, 1); got {config.residual_fixed_ratio!r}")
    _require_int(config.residual_obs_queries, "residual_obs_queries", minimum=2)
    _require_int(config.residual_val_queries, "residual_val_queries", minimum=1)
    if config.residual_val_queries >= config.residual_obs_queries:
        raise ConfigError(
            f"--residual_val_queries ({config.residual_val_queries}) must be smaller than --residual_obs_queries "
            f"({config.residual_obs_queries}): some observation queries must remain to fit"
        )
    split = config.residual_val_split
    if not isinstance(split, str) or not (
        split in ("interleave", "last") or (split.startswith("random:") and split[7:].isdigit())
    ):
        raise ConfigError(f"--residual_val_split must be interleave, last or random:<seed>; got {split!r}")
    _require_choice(config.residual_select_on, "residual_select_on", RESIDUAL_SELECT_ON)
    _require_choice(config.residual_empty, "residual_empty", RESIDUAL_EMPTY)
    _require_int(config.residual_iters, "residual_iters", minimum=1)
    for name, low, high in (("residual_delta", 0.0, math.inf), ("residual_beta", 0.0, math.inf),
                            ("residual_gate_tau", -math.inf, math.inf), ("residual_gate_min", 0.0, 1.0)):
        value = getattr(config, name)
        if not (_is_number(value) and math.isfinite(value) and low <= value <= high):
            raise ConfigError(f"--{name} must be a finite number in [{low}, {high}]; got {value!r}")
    if not (_is_number(config.residual_gate_alpha) and math.isfinite(config.residual_gate_alpha)
            and config.residual_gate_alpha > 0):
        raise ConfigError(f"--residual_gate_alpha must be a finite number > 0; got {config.residual_gate_alpha!r}")
    if config.residual:
        if config.method == "fullkv":
            raise ConfigError("--residual summarises evicted tokens; --method fullkv evicts nothing")
        if config.method == "streamingllm":
            raise ConfigError(
                "--residual splits a scorer's ranking into main and residual slots; --method streamingllm keeps "
                "tokens by position (sinks + recent), and a smaller main cache would drop its sinks"
            )
        if config.method == "cam" or config.merge != "none":
            merging = "--method cam" if config.method == "cam" else f"--merge {config.merge}"
            raise ConfigError(
                f"--residual keeps the main cache exact and summarises the evicted tokens itself; {merging} already "
                "merges them into the kept entries (they would count twice)"
            )


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
