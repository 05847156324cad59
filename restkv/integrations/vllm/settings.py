"""What ``RESTKV_VLLM`` asks for, and whether vLLM's paged cache can serve it.

The variable holds restkv options as JSON (``{"method": "snapkv", "compression_ratio": 0.9}``, the flat option
names of ``restkv.CompressionConfig``) or the path of a JSON file holding them. Unset or empty, restkv stays out
of vLLM. A paged cache gives every layer and KV head of a request the same blocks, so what it serves is a method
whose budget is one count for every layer and head, scored from the prompt's own attention inputs (its keys,
values and its last queries); everything else is refused here, in one line, before the engine starts.

The scheduler and the workers run in different processes and never exchange a word about a request's
compression: both derive it from the prompt's length (``VllmCompression.evicted_tokens``), so they agree.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from restkv.config import CompressionConfig, ConfigError
from restkv.pipeline.compress import exact_tokens_only_conflicts

#: the environment variable that turns restkv on in every vLLM process
ENVIRONMENT_VARIABLE = "RESTKV_VLLM"


class VllmSettingsError(ValueError):
    """``RESTKV_VLLM`` names something vLLM cannot serve; the message is one line that says what."""


@dataclass(frozen=True)
class VllmCompression:
    """One engine's compression: ``config`` and what it does to a prompt of a given length."""

    config: CompressionConfig

    def kept_tokens(self, prompt_length: int) -> int:
        """Tokens each layer and KV head keeps of a ``prompt_length``-token prompt: the budget, or the whole
        prompt when it fits its budget or the budget cannot exceed what the method always keeps (the window)."""
        budget = self.config.budget_for(prompt_length)
        if budget >= prompt_length or not self.config.policy.compressible_to(self.config.run.window_size, budget):
            return prompt_length
        return budget

    def evicted_tokens(self, prompt_length: int) -> int:
        """Token slots a request of ``prompt_length`` prompt tokens gives back once its prefill is done."""
        return prompt_length - self.kept_tokens(prompt_length)

    @property
    def trailing_queries(self) -> int:
        """The last prompt queries a layer keeps for scoring: the observation window."""
        return max(self.config.run.window_size, 1)


def read_settings(text: str | None = None) -> VllmCompression | None:
    """The engine's compression from ``text`` (default: ``$RESTKV_VLLM``); None when unset or empty.
    Raises ``VllmSettingsError`` naming what is wrong: not JSON, a missing file, an unknown option or method, a
    setting a paged cache cannot hold."""
    text = os.environ.get(ENVIRONMENT_VARIABLE, "") if text is None else text
    if not text.strip():
        return None
    options = _options(text.strip())
    try:
        config = CompressionConfig.from_any(options)
    except (ConfigError, TypeError, ValueError) as error:
        raise VllmSettingsError(f"{ENVIRONMENT_VARIABLE}: {error}") from None
    reason = unsupported(config)
    if reason is not None:
        raise VllmSettingsError(f"{ENVIRONMENT_VARIABLE}: {reason}")
    return VllmCompression(config)


def _options(text: str) -> dict:
    source = "its JSON"
    if not text.startswith(("{", "[")):
        path = Path(text).expanduser()
        if not path.is_file():
            raise VllmSettingsError(f"{ENVIRONMENT_VARIABLE} is neither restkv options as JSON nor an existing file: "
                                    f"{text!r}")
        text, source = path.read_text(), str(path)
    try:
        options = json.loads(text)
    except json.JSONDecodeError as error:
        raise VllmSettingsError(f"{ENVIRONMENT_VARIABLE}: {source} is not valid JSON ({error})") from None
    if not isinstance(options, dict):
        raise VllmSettingsError(f"{ENVIRONMENT_VARIABLE}: {source} must be a JSON object of restkv options, got "
                                f"{type(options).__name__}")
    return options


def unsupported(config: CompressionConfig) -> str | None:
    """Why vLLM's paged cache cannot serve ``config``, naming the option; None when it can."""
    run, policy = config.run, config.policy
    if not policy.evicts:
        return f"--method {run.method} evicts nothing: leave {ENVIRONMENT_VARIABLE} unset to serve without restkv"
    if run.max_capacity_prompts is None and run.compression_ratio is None:
        return "give a prefill budget: max_capacity_prompts or compression_ratio"
    flags = [f"--{flag}" for flag in ("prefill_chunk_size", "decode_budget", "decode_compression_ratio")
             if getattr(run, flag) is not None] + (["--dms_decoding"] if config.compresses_decoding else [])
    if flags:
        return (f"{flags[0]} is not served: vLLM chunks the prefill itself and restkv compresses each prompt once, "
                "after its last chunk")
    if config.prefilter is not None:
        return f"--prefilter {run.prefilter} is not served: vLLM compresses each prompt with one scorer"
    if config.compresses_after_prefill:
        return (f"{' and '.join(config.deferring_flags())} score{'s' if len(config.deferring_flags()) == 1 else ''} "
                "after a second pass or across every layer; vLLM compresses each layer as its prefill ends")
    if policy.question_delimiter is not None:
        return (f"--finch_delimiter {policy.question_delimiter} is taken out of the prompt before the model runs; vLLM "
                "schedules, caches and positions a prompt's tokens as it is given (give --window_size instead)")
    allocation = policy.own_allocation() or run.allocation
    if allocation != "uniform":
        return (f"--allocation {allocation} gives layers or KV heads different budgets; a paged cache holds one "
                "count per request (uniform allocation)")
    conflicts = exact_tokens_only_conflicts(config)
    if conflicts:
        return (f"{' and '.join(conflicts)} store{'s' if len(conflicts) == 1 else ''} more than kept tokens "
                "(summaries, codes, pruned or merged keys); a paged cache holds exact tokens only")
    if policy.needs_hidden_states:
        return f"--method {run.method} scores the attention's input, which vLLM's attention does not see"
    if policy.needs_rotary:
        return f"--method {run.method} reads keys before RoPE, which vLLM's attention does not see"
    if policy.reads_every_query:
        return f"--method {run.method} reads the query of every prompt token; vLLM keeps the last window of them"
    return None


def check_model(compression: VllmCompression, num_layers: int, sliding_windows: list, architecture: str) -> None:
    """Refuse a model the paged cache cannot compress uniformly: sliding-window layers (their blocks are
    recycled by position), or a method that leaves some layers whole (a request's blocks are shared by every
    layer, so a layer that keeps more would need more of them)."""
    windowed = [index for index, window in enumerate(sliding_windows) if window]
    if windowed:
        raise VllmSettingsError(f"{ENVIRONMENT_VARIABLE}: {architecture} has sliding-window layers {windowed[:8]}; "
                                "restkv in vLLM compresses full-attention decoders only")
    whole = [index for index in range(num_layers) if not compression.config.policy.compresses_layer(index)]
    if whole:
        raise VllmSettingsError(f"{ENVIRONMENT_VARIABLE}: --method {compression.config.run.method} leaves layers "
                                f"{whole[:8]} whole; a paged cache gives every layer the same number of tokens")
