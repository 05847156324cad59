"""Shared fixtures. Tests never reach a model hub, and never read a model cache from outside
the test session: the embedded models are dequantised from their GGUF files into a fresh
folder on every run, so the first-load path is what the suite exercises (a warm
``~/.cache/restkv`` once hid a missing dependency of that path). ``RESTKV_TEST_CACHE_DIR``
names a folder to reuse instead, for repeated local runs; CI never sets it."""

import os
import shutil
import tempfile

import pytest  # noqa: E402
import torch  # noqa: E402

from restkv.config import plugins as plugins_module  # noqa: E402
from restkv.config.options import unregister  # noqa: E402
from restkv.integrations.transformers.patching import unpatch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")



torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

_FRESH_CACHE: str | None = None


def pytest_configure(config):
    global _FRESH_CACHE
    reused = os.environ.get("RESTKV_TEST_CACHE_DIR")
    if reused:
        os.environ["RESTKV_CACHE_DIR"] = reused
    else:
        _FRESH_CACHE = tempfile.mkdtemp(prefix="restkv-test-cache-")
        os.environ["RESTKV_CACHE_DIR"] = _FRESH_CACHE


def pytest_unconfigure(config):
    if _FRESH_CACHE is not None:
        shutil.rmtree(_FRESH_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _restore_attention():
    """Every test starts and ends with unpatched attention classes."""
    unpatch()
    yield
    unpatch()


@pytest.fixture(scope="session")
def smollm2():
    """The embedded SmolLM2-135M-Instruct (float32, sdpa) and its tokenizer."""
    from restkv.integrations.transformers.models import load_model, load_tokenizer

    return load_model("smollm2-135m", attn_implementation="sdpa"), load_tokenizer("smollm2-135m")


@pytest.fixture
def refuse_model_loading(monkeypatch):
    """``refuse_model_loading(module, name)``: the test fails if ``module.name`` (a model loader, as the
    module imported it) is called: the error under test must be found before any model loads."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the error was found")

    return lambda module, name: monkeypatch.setattr(module, name, refuse)


@pytest.fixture
def no_model_loading(refuse_model_loading):
    """Fails the test if a runner loads a model: the error under test must be found before."""
    import restkv.integrations.transformers.models

    refuse_model_loading(restkv.integrations.transformers.models, "load_model")


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded SmolLM2-135M-Instruct tokenizer."""
    from restkv.integrations.transformers.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def tiny(tokenizer):
    """A tiny random Llama over SmolLM2's vocabulary: real prompts, fast deterministic answers
    (one per test module, so what a module configures on it stays there)."""
    from tiny_models import tiny_model

    return tiny_model("llama", vocab_size=len(tokenizer))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama over SmolLM2's vocabulary saved as a model folder (weights, config,
    tokenizer): what a script given ``--model_path`` loads, in a fraction of a second."""
    from tiny_models import tiny_model

    from restkv.integrations.transformers.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_folder_of(tmp_path_factory):
    """``tiny_folder_of(family)``: a tiny random model folder over SmolLM2's vocabulary, of a
    ``tiny_models`` family or of ``gpt2`` (a model type restkv does not serve: no ``o_proj``)."""
    from tiny_models import tiny_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from restkv.integrations.transformers.models import load_tokenizer

    folders = {}

    def folder_of(family: str):
        if family not in folders:
            tokenizer = load_tokenizer("smollm2-135m")
            if family == "gpt2":
                model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4))
            else:
                model = tiny_model(family, vocab_size=len(tokenizer))
            folders[family] = tmp_path_factory.mktemp(f"tiny-{family}")
            model.save_pretrained(folders[family])
            tokenizer.save_pretrained(folders[family])
        return folders[family]

    return folder_of


@pytest.fixture(scope="module")
def ruler_dir(tmp_path_factory):
    """RULER data at 600 tokens for SmolLM2: niah_single_1 and fwe, two samples each."""
    from restkv.benchmarks import ruler_data

    out = tmp_path_factory.mktemp("ruler_data")
    ruler_data.main(["--tokenizer", "smollm2-135m", "--lengths", "600", "--tasks", "niah_single_1,fwe",
                     "--num_samples", "2", "--out", str(out)])
    return out


def _counted(monkeypatch, module, name: str) -> list:
    """``module.name`` replaced by itself counting its calls; returns the list it appends to."""
    real, calls = getattr(module, name), []

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


@pytest.fixture
def prefill_calls(monkeypatch):
    """Counts the prefills of restkv.integrations.transformers.generation (each compresses a context once)."""
    import restkv.integrations.transformers.generation

    return _counted(monkeypatch, restkv.integrations.transformers.generation, "_prefill")


@pytest.fixture
def repeated_pieces(monkeypatch) -> list:
    """The context pieces the reconstruction forwards repeat, ``(start, stop)`` row-local, as they run
    (restkv.integrations.transformers.deferred)."""
    import restkv.integrations.transformers.deferred

    real, pieces = restkv.integrations.transformers.deferred._repeated, []

    def recording(piece, last, *args):
        pieces.append((piece, last))
        return real(piece, last, *args)

    monkeypatch.setattr(restkv.integrations.transformers.deferred, "_repeated", recording)
    return pieces


@pytest.fixture
def reconstruction_run(monkeypatch):
    """A query-agnostic run with reconstruction observation: its ``flags``, the reconstruction
    ``passes`` made (restkv.integrations.transformers.deferred, one per compressed context), and ``check(folder, records,
    num_layers, budget)``: every line says its context was compressed to ``budget`` tokens per
    layer before its question and answer, and the folder records the observation."""
    import json
    import types

    import restkv.integrations.transformers.deferred

    def check(folder, records, num_layers, budget):
        assert records
        for record in records:
            assert record["question_tokens"] > 0 and record["kv_layers_compressed"] == num_layers
            assert record["kv_tokens_stored"] == budget + record["question_tokens"] + record["new_tokens"] - 1
            assert record["kv_tokens_stored"] < record["kv_tokens_seen"] and "compressed" not in record
        config = json.loads((folder / "run_meta.json").read_text())["settings"]["config"]
        assert (config["observation"], config["reconstruction_chunk"]) == ("reconstruction", 32)

    flags = ["--query_agnostic", "--observation", "reconstruction", "--reconstruction_chunk", "32"]
    return types.SimpleNamespace(flags=flags, passes=_counted(monkeypatch, restkv.integrations.transformers.deferred, "_reconstruct"),
                                 check=check)


@pytest.fixture
def fresh_plugins(monkeypatch):
    """Plugins loaded anew in a test, and the parts they registered unregistered after it (the plugin tests)."""
    monkeypatch.setattr(plugins_module, "_LOADED", {})
    yield
    for plugin in plugins_module._LOADED.values():
        for kind, name in plugin.parts:
            unregister(kind, name)
