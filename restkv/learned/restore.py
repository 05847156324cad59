"""RestoreKV's learned parts (``--method restorekv``): the restore embeddings and the low-rank adapter of
the restore pass, their file, and the adapter applied for one pass only.

The file (safetensors) holds ``restore_embeddings`` ``[n, D]`` (the name kvpress' ``RestoreKVPress``
reads) and, per adapted projection, ``layers.{l}.self_attn.{proj}.lora_A.weight`` ``[r, in]`` and
``...lora_B.weight`` ``[out, r]`` for ``proj`` among ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``;
its metadata holds ``lora_scale`` (the factor of the low-rank term) and, for a file
``save_restore_weights`` wrote, how it was made (``training``, with the held-out report it cannot be
written without). ``peft`` is not a dependency: the adapter is ``y = W x + scale B A x``, added by forward
hooks on the projections while ``RestoreWeights.adapted`` is open, and gone when it closes.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from restkv.config.options import ConfigError
from restkv.files.reading import finite_floats, load_safetensors, read_file_once

#: the restore weights shipped for the embedded default model (how they were made: the file's metadata)
SHIPPED_RESTORE = Path(__file__).parent / "weights" / "restorekv_smollm2-135m.safetensors"
#: the attention projections the adapter may change
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
EMBEDDINGS = "restore_embeddings"
_ADAPTER_NAME = re.compile(r"layers\.(\d+)\.self_attn\.(\w+)\.lora_([AB])\.weight")


@dataclass
class RestoreWeights:
    """The restore embeddings ``[n, D]`` and the adapter: ``(A [r, in], B [out, r])`` per
    ``(layer, projection)``, its term scaled by ``scale``."""

    embeddings: torch.Tensor
    adapters: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    scale: float = 1.0
    training: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        """The restore tokens ``n``: the slots of each head's budget they fill."""
        return self.embeddings.shape[0]

    def parameters(self) -> list[torch.Tensor]:
        return [self.embeddings, *(tensor for pair in self.adapters.values() for tensor in pair)]

    @contextlib.contextmanager
    def adapted(self, decoder) -> Iterator[None]:
        """Within the block, every adapted projection of ``decoder`` (``decoder.layers[l].self_attn.<proj>``)
        adds ``scale B A x`` to its output; the hooks are removed when it closes, so the model is unchanged."""
        hooks = []
        try:
            for (layer, name), (down, up) in self.adapters.items():
                projection = getattr(decoder.layers[layer].self_attn, name)
                hooks.append(projection.register_forward_hook(_low_rank(down, up, self.scale)))
            yield
        finally:
            for hook in hooks:
                hook.remove()


def _low_rank(down: torch.Tensor, up: torch.Tensor, scale: float):
    def hook(module, inputs, output):
        x = inputs[0]
        return output + scale * torch.nn.functional.linear(torch.nn.functional.linear(x, down.to(x.dtype)),
                                                           up.to(x.dtype))
    return hook


def new_restore_weights(decoder, tokens: int, rank: int, scale: float, generator: torch.Generator) -> RestoreWeights:
    """Untrained weights for ``decoder``: ``tokens`` embeddings drawn from its vocabulary's embeddings (the
    scale its inputs have), and a rank-``rank`` adapter on every projection of ``PROJECTIONS`` whose ``B``
    is zero (LoRA's start: the restore pass begins as the plain model's)."""
    table = decoder.embed_tokens.weight.detach().float()
    embeddings = table[torch.randint(table.shape[0], (tokens,), generator=generator)].clone()
    adapters = {}
    for index, layer in enumerate(decoder.layers):
        for name in PROJECTIONS:
            weight = getattr(layer.self_attn, name).weight
            down = torch.randn(rank, weight.shape[1], generator=generator) / weight.shape[1] ** 0.5
            adapters[(index, name)] = (down, torch.zeros(weight.shape[0], rank))
    return RestoreWeights(embeddings, adapters, scale)


def save_restore_weights(path: str | Path, weights: RestoreWeights, training: dict) -> None:
    """Write ``weights`` with ``training`` in the metadata; a ``ValueError`` if ``training`` has no
    ``held_out`` report (restore tokens are judged on text they never saw)."""
    if not training.get("held_out"):
        raise ValueError(f"{path}: no held-out report in the training record; restore weights are written with one")
    tensors = {EMBEDDINGS: weights.embeddings.detach().float().contiguous()}
    for (layer, name), (down, up) in weights.adapters.items():
        tensors[f"layers.{layer}.self_attn.{name}.lora_A.weight"] = down.detach().float().contiguous()
        tensors[f"layers.{layer}.self_attn.{name}.lora_B.weight"] = up.detach().float().contiguous()
    save_file(tensors, str(path), metadata={"format": "pt", "lora_scale": repr(float(weights.scale)),
                                            "training": json.dumps(training)})


def restore_weights_of(path: str) -> RestoreWeights:
    """The weights a ``--restore_weights`` file holds (read once while unchanged; anything else is a
    ``ConfigError`` naming the flag)."""
    return read_file_once(path, "--restore_weights", _read_restore_weights)


def _read_restore_weights(path: str) -> RestoreWeights:
    tensors = load_safetensors(path, "--restore_weights")
    if EMBEDDINGS not in tensors:
        raise ConfigError(f"--restore_weights {path!r} holds no {EMBEDDINGS} [n, hidden]")
    floats = finite_floats("--restore_weights", path, tensors)
    embeddings = floats.pop(EMBEDDINGS)
    if embeddings.dim() != 2 or embeddings.shape[0] < 1:
        raise ConfigError(f"--restore_weights {path!r}: {EMBEDDINGS} is {list(embeddings.shape)}; it must be "
                          "[n, hidden] with n >= 1")
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in floats.items():
        match = _ADAPTER_NAME.fullmatch(name)
        if match is None or match.group(2) not in PROJECTIONS:
            raise ConfigError(f"--restore_weights {path!r}: unknown entry {name} (expected {EMBEDDINGS} and "
                              f"layers.{{l}}.self_attn.{{{','.join(PROJECTIONS)}}}.lora_{{A,B}}.weight)")
        halves.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    adapters = {}
    for (layer, name), pair in sorted(halves.items()):
        prefix = f"layers.{layer}.self_attn.{name}"
        if set(pair) != {"A", "B"}:
            raise ConfigError(f"--restore_weights {path!r}: {prefix} has lora_{''.join(pair)} without its pair")
        down, up = pair["A"], pair["B"]
        if down.dim() != 2 or up.dim() != 2 or up.shape[1] != down.shape[0]:
            raise ConfigError(f"--restore_weights {path!r}: {prefix}.lora_A is {list(down.shape)} and lora_B "
                              f"{list(up.shape)}; they must be [r, in] and [out, r]")
        adapters[(layer, name)] = (down, up)
    with safe_open(path, framework="pt") as handle:
        metadata = handle.metadata() or {}
    try:
        scale = float(metadata.get("lora_scale", "1.0"))
    except ValueError:
        raise ConfigError(f"--restore_weights {path!r}: lora_scale {metadata['lora_scale']!r} is no number") from None
    return RestoreWeights(embeddings, adapters, scale, json.loads(metadata.get("training", "{}")))
