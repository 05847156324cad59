"""The configuration of a compression run: parts composed from flat options.

A run is composed of registered parts (``restkv.config.options``), each owning its options:

* the **method** (``--method``): a policy in ``restkv/policies/`` that scores tokens;
* the **allocation** (``--allocation``): how the budget is spread over layers and KV heads
  (``restkv.allocation``; a method such as ``pyramidkv`` fixes its own);
* the **merge** (``--merge``): an optional step that folds evicted tokens into kept ones;
* **switches** turned on by a boolean flag named after them (``--residual``: ResKV;
  ``--think``: ThinK's key-channel pruning; a method may be defined with a switch on, as
  ``--method think`` is SnapKV with ``--think``);
* the **quantisation** (``--quant_method``): how the compressed cache stores its entries
  (``restkv.quantization``: KIVI or KVQuant codes; default: exact).

Around them sit the options every run has (``RunOptions``): the budget, the observation
window, the seed. Budget semantics (as in the original ReST-KV release):
``max_capacity_prompts`` is the number of tokens each layer keeps **per KV head**,
observation window included; ``compression_ratio`` is the fraction of the prompt that is
removed, so a row of ``L`` real tokens keeps ``floor(L * (1 - compression_ratio))`` tokens.

``CompressionConfig(method=..., **flat)`` is the one place that maps the flat flags of the
original release (``--pooling``, ``--use_wo``, ``--floor``, ...) onto the parts: each flag
goes to the active part that declares it. A flag that no active part uses (``--pooling``
with ``--method h2o``, whose scores are not smoothed) is ignored with a warning that names
it and the parts it belongs to, and is not part of the config: ``config.pooling`` is None
and ``to_dict`` (what run settings record) says None. A common option whose switch is off
(``--decode_interval`` without ``--decode_budget``, ``--reconstruction_chunk`` or
``--reconstruction_reduce`` without the reconstruction observation) is ignored the same way,
its default recorded. Unknown names and bad values are errors that name the flag. Sweeps can
therefore pass one set of flags to every method.

``replace(**changes)`` keeps the options given before unless changed, and drops those that
no part of the new composition uses (switching ``--method restkv`` to ``snapkv`` drops
``--alpha``); options a part derives (ReST-KV's ``temporal`` from ``use_ema``, each method's
own ``pooling`` default) are derived again.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

from restkv.config.options import (KIND_FLAGS, ConfigError, Options, OptionSpec, activation_flag, lookup, option,
                                   option_specs, registered, registry_version)
from restkv.config.parts import check_composed, flat_options, has_parts

__all__ = ["CompressionConfig", "ConfigError", "ModelShape", "RunOptions", "config_from_spec", "method_spec_options",
           "option_names"]


#: the queries that score a prompt (``restkv.scoring.observation``): its last tokens, or the model repeating it
OBSERVATIONS = ("window", "reconstruction")
#: how a scorer's aggregation over its observation queries reads the reconstruction queries
RECONSTRUCTION_REDUCTIONS = ("max", "mean")
#: what the model reads before it repeats each chunk of the context
#: (``restkv.integrations.transformers.reconstruction_prompt`` builds each)
RECONSTRUCTION_PROMPTS = ("instruction", "none", "closing", "user_turn")
#: context tokens one reconstruction forward repeats, unless the method or ``--reconstruction_chunk``
#: says otherwise (KVzip's)
RECONSTRUCTION_CHUNK = 2048


def kept_at_ratio(length: int, ratio: float) -> int:
    """``floor(length * (1 - ratio))``, float noise rounded away first: 1000 * (1 - 0.9) is
    99.99999999999997, which must keep 100."""
    return math.floor(round(length * (1.0 - float(ratio)), 9))


@dataclass(frozen=True)
class RunOptions(Options):
    """What every run has, whatever its parts: method and part names, budget, window, seed."""

    method: str = option("snapkv", "compression method (see restkv.available_methods())")
    max_capacity_prompts: int | None = option(
        None, "tokens kept per layer and KV head, observation window included", minimum=1
    )
    compression_ratio: float | None = option(
        None, "fraction of each row's prompt that is removed, in (0, 1); exclusive with --max_capacity_prompts"
    )
    window_size: int = option(
        32, "observation window: the last tokens that score the rest and are always kept", minimum=0
    )
    allocation: str | None = option(
        None,
        "how the budget is spread over layers and KV heads; default: the method's own (pyramid for pyramidkv, "
        "adakv for adakv, headkv for headkv, uniform for the rest)",
    )
    merge: str = option("none", "merge evicted tokens into kept ones after selection (pivot: LOOK-M; similarity: "
                        "kvpress' MergingPress; cam: CaM's value merging); default: the method's own (cam for --method "
                        "cam)")
    quant_method: str = option(
        "none", "store the compressed cache quantised (kivi: KIVI's per-channel keys and per-token values; kvquant: "
        "the same with exact outliers; see restkv.quantization); default: exact"
    )
    observation: str | None = option(
        None,
        "the queries that score the prompt: the last --window_size prompt tokens (window), or the model repeating "
        "the context after its prefill (reconstruction, KVzip's; the context is compressed once, for any later "
        "question); default: the method's own (reconstruction for kvzip, window for the rest)",
        OBSERVATIONS,
    )
    reconstruction_chunk: int | None = option(
        RECONSTRUCTION_CHUNK, "--observation reconstruction: context tokens repeated per extra forward; default: "
        "the method's own (KVzip's 2048; 512 for kvgrad, KVgrad's; the whole context at once for kvcompose, "
        "KVCompose's single replay)", minimum=1
    )
    reconstruction_reduce: str = option(
        "max",
        "--observation reconstruction: how a scorer's aggregation over its observation queries (SnapKV's sum, "
        "AdaKV's mean, ReST-KV's temporal aggregate) reads the reconstruction queries: the largest attention any of "
        "them gives a token (KVzip's: a token matters if some part of the context needs it) or their mean",
        RECONSTRUCTION_REDUCTIONS,
    )
    reconstruction_prompt: str = option(
        "none",
        "--observation reconstruction: what the model reads before it repeats the context: nothing (none; the best "
        "of the four on held-out text, docs/methods/reconstruction.md); KVzip's instruction continuing the user "
        "turn, then the template's closing (instruction, the reference's); the template's closing alone (closing); "
        "the user turn closed and opened again as it began (user_turn)",
        RECONSTRUCTION_PROMPTS,
    )
    prefill_chunk_size: int | None = option(
        None, "feed the prompt in chunks of this many tokens, compressing after each (no layer holds more than "
        "budget + chunk entries); default: one pass", minimum=1,
    )
    decode_budget: int | None = option(
        None, "compress during generation too: every --decode_interval new tokens each layer evicts back to this "
        "many entries per KV head (prompt and generated tokens together); default: off", minimum=1,
    )
    decode_compression_ratio: float | None = option(
        None, "compress during generation too, to a share of every token seen: every --decode_interval new tokens "
        "each layer keeps floor(seen * (1 - R)) entries per KV head (kvpress' CompressionRatioDecodingPress); "
        "exclusive with --decode_budget; default: off")
    decode_interval: int = option(32, "--decode_budget, --decode_compression_ratio: generated tokens between two "
                                  "compressions", minimum=1)
    decode_method: str | None = option(
        None, "--decode_budget, --decode_compression_ratio: the method that scores the compressions during "
        "generation (kvpress' PrefillDecodingPress: one method for the prompt, another while decoding; its options "
        "are the same flags); default: --method")
    prefilter: str | None = option(
        None, "a method that first keeps floor(N (1 - --prefilter_ratio)) of each row's N prompt tokens (its "
        "protected tokens and --method's among them); --method then ranks only those, to the run's budget "
        "(kvpress' ComposedPress of two evicting presses; its options are the same flags); default: none")
    prefilter_ratio: float | None = option(
        None, "--prefilter: the fraction of the prompt the prefilter removes, in [0, 1)")
    seed: int = option(0, "seed of the run (the random control policy's scores, Python/NumPy/torch)", minimum=0)

    def validate(self) -> None:
        ratio = self.compression_ratio
        if ratio is not None and not 0.0 < ratio < 1.0:
            raise ConfigError(f"--compression_ratio must lie in the open interval (0, 1); got {ratio!r}")
        if self.max_capacity_prompts is not None and ratio is not None:
            raise ConfigError("set either --max_capacity_prompts or --compression_ratio, not both")
        if self.prefilter is not None and self.prefilter_ratio is None:
            raise ConfigError(f"--prefilter {self.prefilter} keeps a share of the prompt: give --prefilter_ratio R")
        if self.prefilter_ratio is not None and not 0.0 <= self.prefilter_ratio < 1.0:
            raise ConfigError(f"--prefilter_ratio must lie in [0, 1); got {self.prefilter_ratio!r}")
        decode_ratio = self.decode_compression_ratio
        if decode_ratio is not None and not 0.0 <= decode_ratio < 1.0:
            raise ConfigError(f"--decode_compression_ratio must lie in [0, 1); got {decode_ratio!r}")
        if self.decode_budget is not None and decode_ratio is not None:
            raise ConfigError("set either --decode_budget or --decode_compression_ratio, not both")

    @property
    def compresses_decoding(self) -> bool:
        """Whether generation is compressed too (a decode budget, fixed or a share of the tokens seen)."""
        return self.decode_budget is not None or self.decode_compression_ratio is not None


_RUN_NAMES = tuple(option_specs(RunOptions))
#: the options of the prompt's compression that the compressions during generation do not read
_PROMPT_ONLY_OPTIONS = ("method", "decode_method", "observation", "prefill_chunk_size", "max_capacity_prompts",
                        "compression_ratio")

#: common options that act only while another setting is on: name -> (the flag that turns it on,
#: whether the run has it on, from its common options, its method and the flat options given); given while it is
#: off they are ignored with a warning, as an option of an inactive part is
_SWITCHED_RUN_OPTIONS = {
    **{name: ("--decode_budget, --decode_compression_ratio or --dms_decoding",
              lambda run, policy_cls, given: run.compresses_decoding or _dms_decoding(given))
       for name in ("decode_interval", "decode_method")},
    "prefilter_ratio": ("--prefilter", lambda run, policy_cls, given: run.prefilter is not None),
    **{name: ("--observation reconstruction",
              lambda run, policy_cls, given: (run.observation or policy_cls.default_observation) == "reconstruction")
       for name in ("reconstruction_chunk", "reconstruction_reduce", "reconstruction_prompt")},
}


def _dms_decoding(given: Mapping[str, Any]) -> bool:
    """Whether the flat options ask DMS's threshold eviction during generation (``--dms --dms_decoding``)."""
    return bool(given.get("dms") and given.get("dms_decoding"))


def _idle_run_options(run: RunOptions, policy_cls: type, given: Mapping[str, Any]) -> set[str]:
    """The ``_SWITCHED_RUN_OPTIONS`` that ``run`` under ``policy_cls`` (and the flat options ``given``) leaves off."""
    return {name for name, (_, is_on) in _SWITCHED_RUN_OPTIONS.items() if not is_on(run, policy_cls, given)}


@dataclass(frozen=True)
class ModelShape:
    """What a config is checked against when it is given to a model (``CompressionConfig.check_model``).

    hidden_size: the width of the hidden states the attention reads (what files of per-layer
    weights on them, KVzap's and Fast KVzip's, must take).
    sliding_windows: per layer, the sliding window of its attention, or None (full attention).
    element_size: bytes of one cached number (the model's dtype).
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    sliding_windows: tuple[int | None, ...]
    element_size: int


class CompressionConfig:
    """The composed, validated configuration of a compression run.

    Attributes
    ----------
    run: ``RunOptions`` (method, budget, window, seed; ``allocation`` resolved).
    policy: the method's policy, built with its options (``restkv.policies``).
    allocator: the allocation part (``restkv.allocation``).
    merger: the merge part, or None.
    quantizer: the quantisation part (``--quant_method``), or None.
    switches: the parts turned on by their flag (``--residual``) or by the method, as a tuple.
    """

    def __init__(self, method: str | None = None, **options: Any) -> None:
        """``CompressionConfig(method="snapkv", kernel_size=7, allocation="adakv", residual=True, ...)`` (the flat
        release names), or the same parts as values: ``CompressionConfig(policy=SnapKV(kernel_size=7),
        allocation=AdaKVAllocation(), switches=[ResidualCache()], ...)`` (``restkv.config.parts``)."""
        options = {**({} if method is None else {"method": method}), **options}
        flat, given = flat_options(options) if has_parts(options) else (options, [])
        self._build({"method": "snapkv", **flat}, inherited=frozenset())
        check_composed(self, given)

    # ------------------------------------------------------------------ composition
    def _build(self, explicit: dict[str, Any], inherited: frozenset[str]) -> None:
        """Compose the parts from flat ``explicit`` options; ``inherited`` names those kept from a
        config being replaced (dropped quietly when the new composition does not use them)."""
        known = option_names()
        unknown = sorted(set(explicit) - set(known))
        if unknown:
            raise ConfigError(f"unknown option(s) {', '.join(unknown)}; known options: {', '.join(known)}")
        run = RunOptions(**{name: explicit[name] for name in _RUN_NAMES if name in explicit})
        policy_cls = lookup("method", run.method)
        # Given (and checked above) but inactive: the run keeps their defaults (a default given, as
        # ``to_dict`` gives every option, changes nothing and is not worth a warning).
        switched_off = {name for name in _idle_run_options(run, policy_cls, explicit)
                        if explicit.get(name) not in (None, getattr(RunOptions, name))}
        if switched_off:
            run = RunOptions(**{name: explicit[name] for name in _RUN_NAMES
                                if name in explicit and name not in switched_off})
        # The policy is built first (its options checked): a method may choose its allocation by one of them.
        policy = policy_cls(**{name: value for name, value in explicit.items()
                               if name in option_specs(policy_cls) and value is not None}).for_run(run)
        allocation = _resolve_allocation(policy, run, explicit)
        allocation_cls = lookup("allocation", allocation)
        merge = _resolve_merge(policy_cls, run)
        merge_cls = None if merge == "none" else lookup("merge", merge)
        quant_cls = None if run.quant_method == "none" else lookup("quantization", run.quant_method, "quant_method")
        switch_flags = {cls.name: cls for cls in registered("switch")}
        for flag in switch_flags:
            if flag in explicit and not isinstance(explicit[flag], bool):
                raise ConfigError(f"--{flag} must be a boolean (--{flag} / --no-{flag}); got {explicit[flag]!r}")
        for flag in policy_cls.own_switches:
            if explicit.get(flag) is False:
                raise ConfigError(f"--method {run.method} is --method {policy_cls.base_method} with --{flag}; "
                                  f"for --no-{flag} use --method {policy_cls.base_method}")
        switch_classes = [cls for flag, cls in switch_flags.items()
                          if explicit.get(flag) or flag in policy_cls.own_switches]
        part_classes = [policy_cls, allocation_cls, *([merge_cls] if merge_cls else []),
                        *([quant_cls] if quant_cls else []), *switch_classes]
        # The method that scores the compressions during generation reads the same flags (built in ``_decoding``).
        decode_cls = (lookup("method", run.decode_method, "decode_method")
                      if run.decode_method is not None and "decode_method" not in switched_off else None)
        prefilter_cls = lookup("method", run.prefilter, "prefilter") if run.prefilter is not None else None
        secondary = [cls for cls in (decode_cls, prefilter_cls) if cls is not None]

        given: dict[type, dict[str, Any]] = {cls: {} for cls in [*part_classes, *secondary]}
        unused: dict[str, Any] = {}
        for name, value in explicit.items():
            if (name in _RUN_NAMES and name not in switched_off) or name in switch_flags or value is None:
                continue
            owners = [cls for cls in given if name in option_specs(cls)]
            for cls in owners:
                given[cls][name] = value
            if not owners and name not in inherited:
                unused[name] = value
        unused = _checked_unused(unused)
        if unused:
            warnings.warn(
                f"restkv: {', '.join(f'--{name}' for name in unused)} not used by {_describe(run, switch_classes)} "
                f"(options of {'; '.join(', '.join(_owner_flags(name)) for name in unused)}); ignored",
                UserWarning,
                stacklevel=3,
            )
        kept = {name: value for name, value in explicit.items()
                if (name in _RUN_NAMES and name not in switched_off) or name in switch_flags
                or any(name in group for group in given.values())}
        set_ = object.__setattr__
        observation = run.observation or policy_cls.default_observation
        if observation == "reconstruction" and not policy_cls.observes_queries:
            raise ConfigError(
                f"--observation reconstruction chooses the queries that score the prompt; --method {run.method} "
                "does not score with queries"
            )
        chunk = (run.reconstruction_chunk if explicit.get("reconstruction_chunk") is not None
                 else policy_cls.default_reconstruction_chunk)
        set_(self, "run", dataclasses.replace(run, allocation=allocation, merge=merge, observation=observation,
                                              reconstruction_chunk=chunk))
        set_(self, "policy", policy)
        set_(self, "allocator", allocation_cls(**given[allocation_cls]))
        set_(self, "merger", merge_cls(**given[merge_cls]) if merge_cls else None)
        set_(self, "quantizer", quant_cls(**given[quant_cls]) if quant_cls else None)
        set_(self, "switches", tuple(cls(**given[cls]) for cls in switch_classes))
        set_(self, "prefilter", self._prefilter(prefilter_cls, given, run))
        set_(self, "_explicit", {**kept, **unused})
        set_(self, "_unused", unused)
        self._check_budget()
        for part in self.parts:
            part.check(self)
        set_(self, "decoding", self._decoding())

    def _check_budget(self) -> None:
        run = self.run
        if not self.policy.evicts:
            for flag in ("prefill_chunk_size", "decode_budget", "decode_compression_ratio"):
                if getattr(run, flag) is not None and (flag == "prefill_chunk_size" or run.decode_method is None):
                    raise ConfigError(f"--{flag} compresses as tokens come; --method {run.method} evicts nothing"
                                      + ("" if flag == "prefill_chunk_size" else
                                         " (--decode_method names the method that compresses during generation)"))
            return
        self._check_recompression()
        if run.max_capacity_prompts is None and run.compression_ratio is None and not run.compresses_decoding:
            raise ConfigError(
                f"--method {run.method} needs a budget: --max_capacity_prompts N (tokens per layer and KV head, "
                "window included) or --compression_ratio R in (0, 1)"
            )

    @property
    def parts(self) -> tuple[Options, ...]:
        """The active parts: policy, allocation, merge and quantisation (if any), switches."""
        return (self.policy, self.allocator, *([self.merger] if self.merger else []),
                *([self.quantizer] if self.quantizer else []), *self.switches)

    def _check_recompression(self) -> None:
        """Chunked prefill and decode-time compression score a layer again and again with its
        newest queries: they need a window of them and a scorer that can rescore."""
        run, policy = self.run, self.policy
        # A chunk's last window_size queries score what the layer holds (and are the window it protects).
        if (run.prefill_chunk_size is not None and policy.observes_queries
                and run.prefill_chunk_size < policy.protected_count(run.window_size, run.prefill_chunk_size)):
            raise ConfigError(
                f"--prefill_chunk_size {run.prefill_chunk_size} must be at least --window_size {run.window_size}: "
                "each chunk's last window_size queries score what the layer holds"
            )
        if (run.decode_budget is not None and run.decode_method is None
                and not policy.compressible_to(run.window_size, run.decode_budget)):
            raise ConfigError(f"--decode_budget {run.decode_budget} must exceed {policy.always_kept(run.window_size)}")
        if self.compresses_after_prefill and run.prefill_chunk_size is not None and not self.fixed_scores:
            raise ConfigError(
                f"--prefill_chunk_size compresses as tokens come; {' and '.join(self.deferring_flags())} needs the "
                f"whole prompt first (scores read by --observation {run.observation} change with each chunk's "
                "queries; reconstruction and query-free scores are ranked chunk by chunk)"
            )

    def deferring_flags(self) -> list[str]:
        """The settings that make layers wait for the whole prefill (``compresses_after_prefill``),
        as the flags that chose them, for messages that refuse what cannot wait."""
        run, flags = self.run, []
        if run.observation == "reconstruction":
            chosen = self._explicit.get("observation") == "reconstruction"
            flags.append("--observation reconstruction" + ("" if chosen else f" (--method {run.method}'s own)"))
        if self.allocator.model_wide:
            own = self.policy.own_allocation() is not None
            flags.append(f"--method {run.method}'s model-wide {run.allocation} allocation" if own
                         else f"--allocation {run.allocation}")
        return flags

    def rescoring_flags(self, every_method: bool = False) -> list[str]:
        """The settings that compress layers again with this config's parts after their prefill (``rescores``), as
        flags: chunked prefill, and generation unless ``--decode_method`` names the method it runs
        (``every_method``: generation whatever method)."""
        generation = self.run.decode_method is None or every_method
        names = ("prefill_chunk_size",) + (("decode_budget", "decode_compression_ratio") if generation else ())
        flags = [f"--{name} {getattr(self.run, name)}" for name in names if getattr(self.run, name) is not None]
        dms = self.switch("dms")
        if generation and dms is not None and dms.dms_decoding:
            flags.append("--dms_decoding")
        return flags

    def _prefilter(self, prefilter_cls: type | None, given: dict[type, dict[str, Any]], run: RunOptions):
        """``--prefilter``'s policy, built with the same flags, or None; refused where it cannot rank the prompt
        before ``--method`` (one pass over the whole prompt, with what the prompt's compression reads)."""
        if prefilter_cls is None:
            return None
        name = f"--prefilter {run.prefilter}"
        if not prefilter_cls.evicts:
            raise ConfigError(f"{name} evicts nothing: a prefilter keeps a share of the prompt by its scores")
        if run.prefill_chunk_size is not None:
            raise ConfigError(f"{name} ranks the whole prompt once; --prefill_chunk_size {run.prefill_chunk_size} "
                              "compresses it chunk by chunk")
        observation = run.observation or lookup("method", run.method).default_observation
        if prefilter_cls.default_observation == "reconstruction" and observation != "reconstruction":
            raise ConfigError(f"{name} scores by the model repeating the prompt (--observation reconstruction); "
                              f"--method {run.method} reads the {observation} observation")
        if prefilter_cls.needs_hidden_states and observation == "reconstruction":
            raise ConfigError(f"{name} scores the prompt's hidden states, which a layer waiting for the "
                              "reconstruction does not keep")
        return prefilter_cls(**given[prefilter_cls]).for_run(run)

    def _decoding(self) -> "CompressionConfig | None":
        """The config the compressions during generation run: None when generation is not compressed; itself
        without ``--decode_method``; else ``--decode_method``'s, built from the same flags less the prompt's own
        (its budget, observation and a model-wide allocation). Generation is compressed one layer at a time with
        its newest queries, so a method that needs the model repeating the prompt or every layer at once cannot."""
        run = self.run
        if not self.compresses_decoding:
            return None
        flag, method = ("--method", run.method) if run.decode_method is None else ("--decode_method", run.decode_method)
        method_cls = lookup("method", method, "decode_method")
        if (run.observation if run.decode_method is None else method_cls.default_observation) == "reconstruction":
            raise ConfigError(f"{flag} {method} scores the prompt by the model repeating it (--observation "
                              "reconstruction), which generated tokens are not; generation is compressed one layer "
                              "at a time with its newest queries: give --decode_method METHOD (e.g. snapkv)")
        if run.decode_method is None:
            if self.allocator.model_wide:
                raise ConfigError(f"{self.chosen_by(self.allocator)} ranks tokens across every layer at once; "
                                  "generation is compressed one layer at a time: give --decode_method METHOD "
                                  "(e.g. snapkv)")
            return self
        options = {name: value for name, value in self._explicit.items() if name not in _PROMPT_ONLY_OPTIONS}
        if self.allocator.model_wide:
            options.pop("allocation", None)
        with warnings.catch_warnings():  # the prompt's own options are not the decode method's
            warnings.simplefilter("ignore")
            decoding = CompressionConfig(**options, method=method)
        if decoding.scores_on_arrival and self.compresses_after_prefill:
            raise ConfigError(f"--decode_method {method} ranks the scores each token got as it came; "
                              f"{' and '.join(self.deferring_flags())} compress the prompt after its whole prefill, "
                              "when its tokens were not scored that way: give a --decode_method that scores with "
                              "the newest queries or the keys (e.g. snapkv, l2norm)")
        return decoding

    def check_model(self, model: ModelShape) -> None:
        """Refuse, before the model runs, what only its shape shows cannot work (``ConfigError``):
        recompression of sliding-window layers, and each part's own checks (``Options.check_model``)."""
        for window in sorted({w for w in model.sliding_windows if w is not None}):
            layers = [index for index, w in enumerate(model.sliding_windows) if w == window]
            self._check_sliding_layers(window, layers)
        for part in self.parts:
            part.check_model(self, model)
        if self.decoding is not None and self.decoding is not self:
            self.decoding.check_model(model)

    def _check_sliding_layers(self, window: int, layers: list[int]) -> None:
        """Chunked prefill and decode budgets compress full-attention layers again; a sliding-window
        layer that its prefill compressed cannot be, so its prefill must keep all it sees (at most
        ``window - 1`` tokens): the budget of every prompt long enough to be chunked must reach that."""
        run, held = self.run, window - 1
        if not self.compresses_again or (run.max_capacity_prompts is None and run.prefill_chunk_size is None):
            return  # a ratio on unchunked prompts: only each prompt's length tells (checked at its prefill)
        chunk = run.prefill_chunk_size
        limit = held if chunk is None else min(chunk, held)
        if run.max_capacity_prompts is not None:
            if run.max_capacity_prompts >= limit:
                return
            keeping, fix = f"--max_capacity_prompts {run.max_capacity_prompts}", f"raise --max_capacity_prompts to {limit}"
        else:
            if self.budget_for(chunk) >= limit:
                return
            working = next(c for c in itertools.count(chunk + 1) if self.budget_for(c) >= min(c, held))
            keeping = f"--compression_ratio {run.compression_ratio} on a prompt of {chunk} tokens (one chunk)"
            fix = f"use chunks of at least {working} tokens or --max_capacity_prompts {held}"
        flags = self.rescoring_flags(every_method=True)
        raise ConfigError(
            f"{' and '.join(flags)} compress{'es' if len(flags) == 1 else ''} full-attention layers again; layers "
            f"{layers} have a sliding window of {window} tokens, and {keeping} keeps fewer than their {limit} at the "
            f"prefill: they would be compressed, and a compressed sliding-window layer is not compressed again: {fix}"
        )

    @property
    def rescores(self) -> bool:
        """Whether this config's parts compress layers again after their prefill (``rescoring_flags``)."""
        return bool(self.rescoring_flags())

    @property
    def compresses_again(self) -> bool:
        """Whether layers are compressed again after their prefill, by any method (chunked prefill, generation):
        such layers are held compressed from the start and remember their newest queries."""
        return self.run.prefill_chunk_size is not None or self.compresses_decoding

    @property
    def scores_on_arrival(self) -> bool:
        """Whether this config compresses generation by scores taken once as each token came: a scorer of each token
        alone that reads what a layer does not keep (hidden states, the RoPE tables of its keys), or DMS's
        threshold alone; a scorer of keys alone scores the held keys again."""
        policy, threshold_alone = self.policy, self.compresses_decoding and not self.run.compresses_decoding
        return policy.scores_each_token_alone and (policy.needs_hidden_states or policy.needs_rotary
                                                   or threshold_alone)

    @property
    def compresses_decoding(self) -> bool:
        """Whether generation is compressed: to a budget (``--decode_budget``, ``--decode_compression_ratio``) or
        by DMS's threshold (``--dms_decoding``)."""
        dms = self.switch("dms")
        return self.run.compresses_decoding or (dms is not None and dms.dms_decoding)

    @property
    def fixed_scores(self) -> bool:
        """Whether a token's score is fixed once its chunk is scored (reconstruction queries, or no
        queries at all), so a chunked prefill may rank stored scores beside new ones."""
        return self.run.observation == "reconstruction" or not self.policy.observes_queries

    @property
    def compresses_after_prefill(self) -> bool:
        """Whether layers wait for the whole prefill before compressing (``restkv.integrations.transformers.deferred``):
        reconstruction observation, or an allocation across the model."""
        return self.run.observation == "reconstruction" or self.allocator.model_wide

    def chosen_by(self, part: Options) -> str:
        """The flag that made ``part`` active, as the user gave it: ``--merge pivot``, ``--residual``, or
        ``--method cam`` for a part the method is defined with (its allocation, merge or switches)."""
        policy = self.policy
        own = ((part is self.merger and policy.own_merge is not None)
               or (part is self.allocator and policy.own_allocation() is not None)
               or (part in self.switches and part.name in policy.own_switches))
        return f"--method {self.run.method}" if own else activation_flag(type(part))

    def switch(self, name: str) -> Options | None:
        """The active switch part named ``name`` (``"residual"``), or None."""
        return next((part for part in self.switches if part.name == name), None)

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_any(cls, config: "CompressionConfig | Mapping[str, Any]") -> "CompressionConfig":
        """Accept a config or a dict of flat option names (the original release's flag names)."""
        if isinstance(config, CompressionConfig):
            return config
        if not isinstance(config, Mapping):
            raise ConfigError(f"expected a CompressionConfig or a dict of its options, got {type(config).__name__}")
        return cls.from_options(**config)

    @classmethod
    def from_options(cls, **options: Any) -> "CompressionConfig":
        """Build a config from flat options; unknown names are rejected with the list of known ones."""
        return cls(**options)

    def replace(self, **changes: Any) -> "CompressionConfig":
        """A copy with some options changed (validated again).

        Options given before are kept unless changed, except those no part of the new
        composition uses (they belonged to the old method or allocation); options a part
        derives are derived again. A part given as a value (``policy=H2O()``) brings all its options:
        none of those given before is kept.
        """
        config = object.__new__(CompressionConfig)
        flat, given = flat_options(changes) if has_parts(changes) else (changes, [])
        kept = {name: value for name, value in self._explicit.items()
                if not any(name in option_specs(type(part)) for _, part in given)}
        inherited = frozenset(kept) - frozenset(flat)
        config._build({**kept, **flat}, inherited=inherited)
        check_composed(config, given)
        return config

    # ------------------------------------------------------------------ reading
    def budget_for(self, length: int) -> int:
        """Tokens kept per KV head for a row of ``length`` real tokens (never more than the row has)."""
        run = self.run
        if not self.policy.evicts or (run.max_capacity_prompts is None and run.compression_ratio is None):
            return length  # nothing evicted at prefill (a --decode_budget alone)
        if run.max_capacity_prompts is not None:
            return min(run.max_capacity_prompts, length)
        return min(kept_at_ratio(length, run.compression_ratio), length)

    def files(self) -> dict[str, str]:
        """The files the run reads, by the option that names them (``--indexmem_weights``, ``--head_scores``)."""
        return {name: value for part in self.parts for name, spec in option_specs(type(part)).items()
                if spec.names_file and (value := part.file_read(name)) is not None}

    def to_dict(self) -> dict[str, Any]:
        """Every flat option: the value a run uses, None where no active part declares it."""
        values = dict.fromkeys(option_names())
        values.update(self.run.options())
        for cls in registered("switch"):
            values[cls.name] = self.switch(cls.name) is not None
        for part in self.parts:
            values.update(part.options())
        return values

    def idle_run_options(self) -> set[str]:
        """The common options this run does not use: those that act only while a setting it has off is on
        (``--reconstruction_prompt`` of a window scorer)."""
        return _idle_run_options(self.run, type(self.policy), self._explicit)

    def describe(self) -> str:
        """``--method snapkv --allocation adakv --residual``: the composition, as flags."""
        return _describe(self.run, [type(part) for part in self.switches])

    def __getattr__(self, name: str) -> Any:
        """A flat option: the active part's value; for an option no active part uses, the value
        given (validated, ignored by the run) or None."""
        if name.startswith("_") or name not in option_names():
            raise AttributeError(f"{type(self).__name__} has no option {name!r}")
        for part in (self.run, *self.parts):
            if name in option_specs(type(part)):
                return getattr(part, name)
        if any(cls.name == name for cls in registered("switch")):
            return self.switch(name) is not None
        return self._unused.get(name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"CompressionConfig is immutable; use .replace({name}=...)")

    def _key(self) -> tuple:
        return (self.run, self.policy, self.allocator, self.merger, self.quantizer, self.switches)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CompressionConfig) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        defaults = {name: specs[0][1].default for name, specs in _flat_specs().items()}
        shown = {name: value for name, value in self.to_dict().items()
                 if value is not None and (name in ("method",) or value != defaults.get(name))}
        return f"CompressionConfig({', '.join(f'{name}={value!r}' for name, value in shown.items())})"


def _checked_unused(options: dict[str, Any]) -> dict[str, Any]:
    """Options no active part uses, checked as if they were used (their declared type, range and
    choices, and the value checks of the allocation, merge or switch that declares them), so a
    bad value fails now rather than in the run that needs it."""
    checked = {name: _flat_specs()[name][0][1].check(value) for name, value in options.items()}
    for kind in ("allocation", "merge", "quantization", "switch"):
        for cls in registered(kind):
            mine = {name: value for name, value in checked.items() if name in option_specs(cls)}
            if mine:
                part = cls(**mine)
                checked.update({name: getattr(part, name) for name in mine})
    return checked


def _resolve_allocation(policy, run: RunOptions, explicit: Mapping[str, Any]) -> str:
    """The method's own allocation, else ``--allocation``, else the one a switch of an allocation
    selects (``--use_pyramid``: the release's pyramid), else uniform."""
    own, given = policy.own_allocation(), run.allocation
    if own is not None and given not in (None, own):
        if policy.base_method is None:
            raise ConfigError(f"--method {run.method} spreads its budget with its own {own} allocation; "
                              f"--allocation {given} does not apply to it")
        raise ConfigError(
            f"--method {run.method} is --method {policy.base_method} with {own} allocation; for another "
            f"allocation use --method {policy.base_method} --allocation {given}"
        )
    # the allocation that declares the switch (not its subclasses)
    selecting = [cls for cls in registered("allocation")
                 if vars(cls).get("selected_by") and explicit.get(cls.selected_by)]
    resolved = own or given or (selecting[0].name if selecting else "uniform")
    for cls in selecting:
        if resolved != cls.name:
            raise ConfigError(f"--{cls.selected_by} selects the {cls.name} allocation; it cannot be combined with "
                              f"{resolved}")
    return resolved


def _resolve_merge(policy_cls: type, run: RunOptions) -> str:
    """The method's own merge (CaM's), else ``--merge``."""
    own = policy_cls.own_merge
    if own is not None and run.merge not in ("none", own):
        raise ConfigError(f"--method {run.method} merges with its own {own} merge; --merge {run.merge} does not "
                          "apply to it")
    return own or run.merge


def _describe(run: RunOptions, switch_classes) -> str:
    parts = [f"--method {run.method}"]
    if run.allocation not in (None, "uniform"):
        parts.append(f"--allocation {run.allocation}")
    if run.merge not in ("none", lookup("method", run.method).own_merge):
        parts.append(f"--merge {run.merge}")
    if run.quant_method != "none":
        parts.append(f"--quant_method {run.quant_method}")
    own = lookup("method", run.method).own_switches
    parts += [f"--{cls.name}" for cls in switch_classes if cls.name not in own]
    return " ".join(parts)


def _owner_flags(name: str) -> list[str]:
    """The flags that activate the parts declaring option ``name`` (or the common option)."""
    if name in _SWITCHED_RUN_OPTIONS:
        return [_SWITCHED_RUN_OPTIONS[name][0]]
    owners = []
    for kind, flag in KIND_FLAGS.items():
        owners += [f"--{flag} {cls.name}" for cls in registered(kind) if name in option_specs(cls)]
    owners += [f"--{cls.name}" for cls in registered("switch") if name in option_specs(cls)]
    return owners


def _flat_specs() -> dict[str, list[tuple[type, OptionSpec]]]:
    """Every flat option name -> the (part class, declaration) pairs that declare it, common
    options first, then switch flags, then methods, allocations, merges and switches (built
    again only when a part was registered since)."""
    if _FLAT_CACHE.get("version") != registry_version():
        _FLAT_CACHE.update(version=registry_version(), table=_build_flat_specs())
    return _FLAT_CACHE["table"]


_FLAT_CACHE: dict[str, Any] = {}


def _build_flat_specs() -> dict[str, list[tuple[type, OptionSpec]]]:
    table: dict[str, list[tuple[type, OptionSpec]]] = {}
    for name, spec in option_specs(RunOptions).items():
        table[name] = [(RunOptions, spec)]
    for cls in registered("switch"):
        table[cls.name] = [(cls, OptionSpec(cls.name, bool, None, False, False, cls.switch_help,
                                            None, None, None, False))]
    for kind in ("method", "allocation", "merge", "quantization", "switch"):
        for cls in registered(kind):
            for name, spec in option_specs(cls).items():
                table.setdefault(name, []).append((cls, spec))
    return table


def option_names() -> list[str]:
    """Every flat option name ``CompressionConfig`` accepts (grows when a part is registered)."""
    return list(_flat_specs())


def flat_option_specs() -> dict[str, list[tuple[type, OptionSpec]]]:
    """``option_names()`` with, for each, the parts that declare it (what the runners turn into flags)."""
    return _flat_specs()


def config_from_spec(spec: str, **budget: Any) -> CompressionConfig:
    """The config of a method spec (``snapkv+residual``, ``method_spec_options``) at ``budget``
    (``max_capacity_prompts=...`` or ``compression_ratio=...``), which a method that evicts
    nothing (``fullkv``) does not take: what the scripts run for each spec, and check before any
    model work."""
    options = method_spec_options(spec)
    return CompressionConfig(**options, **(budget if lookup("method", options["method"]).evicts else {}))


def method_spec_options(spec: str) -> dict[str, Any]:
    """``snapkv+residual+observation=reconstruction`` -> ``{"method": "snapkv", "residual": True,
    "observation": "reconstruction"}``: a method with boolean switches and options, the short form
    the sweep and benchmark scripts take for a variant (values are parsed by the option's type)."""
    method, *parts = spec.split("+")
    table = _flat_specs()
    options: dict[str, Any] = {"method": method}
    for part in parts:
        name, has_value, text = part.partition("=")
        if name not in table:
            switches = sorted(n for n, specs in table.items() if specs[0][1].kind is bool)
            raise ConfigError(f"{spec!r}: {name!r} is not a boolean option; use METHOD+SWITCH (one of "
                              f"{', '.join(switches)}) or METHOD+OPTION=VALUE")
        kind = table[name][0][1].kind
        if not has_value:
            if kind is not bool:
                raise ConfigError(f"{spec!r}: {name} is not a switch; give it a value ({name}=VALUE)")
            options[name] = True
        elif kind in (int, float, str):
            try:
                options[name] = kind(text)
            except ValueError:
                raise ConfigError(f"{spec!r}: {name}={text!r} is not a {kind.__name__}") from None
        else:
            raise ConfigError(f"{spec!r}: {name} takes a {kind.__name__}, which a method spec cannot write")
    return options
