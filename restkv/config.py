"""One validated dataclass holding every compression knob.

Budget semantics (as in the original ReST-KV release): ``max_capacity_prompts`` is the
number of tokens each layer keeps **per KV head**, observation window included. The
alternative ``compression_ratio`` is the fraction of the prompt that is removed, so a row
of ``L`` real tokens keeps ``floor(L * (1 - compression_ratio))`` tokens.

Every error raised here names the flag and the allowed values, so a typo in a sweep
script fails at construction instead of producing a silently different run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

POOLINGS = ("none", "avgpool", "maxpool", "adaptive")
GQA_AGGREGATIONS = ("mean", "max", "sum")
H2O_QUERIES = ("window", "all")


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
    pooling: str = option("avgpool", "spatial smoothing of the scores", POOLINGS)
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

    def __post_init__(self) -> None:
        from restkv.policies import available_methods, get_policy

        if self.method not in available_methods():
            raise ConfigError(
                f"--method {self.method!r} is not a known method; choose one of {', '.join(available_methods())}"
            )
        object.__setattr__(self, "l2norm_skip_layers", tuple(int(i) for i in self.l2norm_skip_layers))
        self._check_budget()
        _require_int(self.window_size, "window_size", minimum=0)
        _require_int(self.kernel_size, "kernel_size", minimum=1)
        if self.kernel_size % 2 == 0:
            raise ConfigError(f"--kernel_size must be odd (got {self.kernel_size}); an even kernel shifts the scores")
        _require_choice(self.pooling, "pooling", POOLINGS)
        _require_choice(self.gqa_score_agg, "gqa_score_agg", GQA_AGGREGATIONS)
        _require_choice(self.h2o_queries, "h2o_queries", H2O_QUERIES)
        _require_int(self.n_sink, "n_sink", minimum=0)
        get_policy(self.method).validate(self)

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
        """A copy with some options changed (validated again)."""
        return CompressionConfig.from_options(**{**self.to_dict(), **changes})

    def budget_for(self, length: int) -> int:
        """Tokens kept per KV head for a row of ``length`` real tokens (never more than the row has)."""
        if self.method == "fullkv":
            return length
        if self.max_capacity_prompts is not None:
            return min(self.max_capacity_prompts, length)
        kept = int(length * (1.0 - float(self.compression_ratio)))
        return min(kept, length)

    def to_dict(self) -> dict[str, Any]:
        """Flat dict of every option, for run metadata."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def option_names() -> list[str]:
    """Every option name ``CompressionConfig`` accepts."""
    return [f.name for f in dataclasses.fields(CompressionConfig)]


def _require_int(value: Any, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"--{name} must be an integer >= {minimum}; got {value!r}")
    if value < minimum:
        raise ConfigError(f"--{name} must be >= {minimum}; got {value}")


def _require_choice(value: Any, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"--{name} {value!r} is not allowed; choose one of {', '.join(choices)}")
