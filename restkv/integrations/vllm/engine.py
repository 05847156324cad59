"""The engine's start: what the whole engine must be for restkv to compress its requests.

``EngineArgs.create_engine_config`` is wrapped (in the process that builds the engine, before any model work):
prefix caching is turned off unless asked for, and refused when asked for (a compressed request's blocks no
longer hold the prefix their hash names); speculative decoding is refused (drafts would be written at
positions the compressed slots do not follow); the model is checked (``settings.check_model``) and a fixed
budget that no prompt exceeds is refused.
"""

from __future__ import annotations

import logging

from restkv.integrations.vllm.settings import ENVIRONMENT_VARIABLE, VllmCompression, VllmSettingsError, check_model

logger = logging.getLogger("vllm.restkv")  # under vLLM's logger, so its handlers print it
_installed: list[bool] = []


def check_engine(compression: VllmCompression, vllm_config) -> None:
    """Refuse an engine restkv cannot compress, in one line naming the setting (``VllmSettingsError``)."""
    model_config = vllm_config.model_config
    if vllm_config.speculative_config is not None:
        raise VllmSettingsError(f"{ENVIRONMENT_VARIABLE}: speculative decoding is not served with restkv (drafts "
                                "would be written where compressed requests hold no slots)")
    if getattr(model_config, "use_mla", False) or model_config.is_hybrid:
        raise VllmSettingsError(f"{ENVIRONMENT_VARIABLE}: {model_config.architecture} is not a plain-attention "
                                "decoder (latent or recurrent layers); restkv cannot score it")
    text_config = model_config.hf_text_config
    num_layers = model_config.get_total_num_hidden_layers()
    layer_types = getattr(text_config, "layer_types", None) or []
    window = getattr(text_config, "sliding_window", None)
    windows = [window if kind == "sliding_attention" else None for kind in layer_types] if layer_types else \
        [window] * num_layers
    check_model(compression, num_layers, windows, model_config.architecture)
    budget = compression.config.run.max_capacity_prompts
    if budget is not None and budget >= model_config.max_model_len:
        raise VllmSettingsError(f"{ENVIRONMENT_VARIABLE}: max_capacity_prompts {budget} is at or above max_model_len "
                                f"{model_config.max_model_len}: no prompt would be compressed")


def install(compression: VllmCompression) -> None:
    """Patch ``EngineArgs.create_engine_config`` in this process (idempotent)."""
    from vllm.engine.arg_utils import EngineArgs

    if _installed:
        return
    create_engine_config = EngineArgs.create_engine_config

    def create_engine_config_(self, *args, **kwargs):
        if self.enable_prefix_caching:
            raise SystemExit(f"error: {ENVIRONMENT_VARIABLE}: enable_prefix_caching cannot serve compressed requests "
                             "(their blocks no longer hold the prefix their hash names); leave it unset")
        self.enable_prefix_caching = False
        vllm_config = create_engine_config(self, *args, **kwargs)
        try:
            check_engine(compression, vllm_config)
        except VllmSettingsError as error:
            raise SystemExit(f"error: {error}") from None
        run = compression.config.run
        logger.info("restkv compresses every prompt with --method %s (%s)", run.method,
                    f"max_capacity_prompts {run.max_capacity_prompts}" if run.max_capacity_prompts is not None
                    else f"compression_ratio {run.compression_ratio}")
        return vllm_config

    EngineArgs.create_engine_config = create_engine_config_
    _installed.append(True)
