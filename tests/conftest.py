"""Shared fixtures. Tests never reach a model hub."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402

from restkv.monkeypatch import unpatch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _restore_attention():
    """Every test starts and ends with unpatched attention classes."""
    unpatch()
    yield
    unpatch()


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct (float32, sdpa) and its tokenizer."""
    from restkv.models import load_model, load_tokenizer

    return load_model("smollm2-135m", attn_implementation="sdpa"), load_tokenizer("smollm2-135m")
