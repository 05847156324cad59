"""KVzap (arXiv 2601.07891): KVzip's scores predicted from the hidden states.

KVzip's reconstruction costs a second pass over the context; KVzap trains, per layer, a small
surrogate that reads the attention's input at each token (the hidden state after the layer's
input norm) and predicts the token's KVzip score for every KV head: a linear map, or a two-layer
GELU MLP. Scoring is then one small product per layer, in prefill (and, in the paper, decoding).
The recent ``--window_size`` tokens are kept as for every restkv scorer (``--window_size 0``:
none, as kvpress' ``KVzapPress``); KVzap is meant to run with threshold eviction
(``--dms --dms_threshold T``: keep what the surrogate scores above ``T``).

``--kvzap_weights FILE``: a safetensors file with kvpress' ``KVzapModel`` layout, one module per
layer: ``layers.{l}.weight`` ``[H_kv, D]`` and ``layers.{l}.bias`` (linear), or
``layers.{l}.0.weight`` ``[hidden, D]``, ``layers.{l}.0.bias``, ``layers.{l}.2.weight``
``[H_kv, hidden]``, ``layers.{l}.2.bias`` (MLP). NVIDIA publishes trained surrogates on the Hub
(``nvidia/KVzap-{linear,mlp}-<model>``); this library does not download: point the flag at a
local copy of their ``model.safetensors``. No surrogate ships for the embedded model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import ConfigError, option, register
from restkv.files.reading import check_shape, finite_floats, load_safetensors, read_file_once
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import Policy, check_weights_fit, layer_weights


@register("method")
@dataclass(frozen=True)
class KVzap(Policy):
    name = "kvzap"
    reference = "KVzap: arXiv 2601.07891"
    observes_queries = False
    needs_hidden_states = True

    kvzap_weights: str | None = option(
        None, "KVzap: safetensors file of the per-layer surrogates (kvpress' KVzapModel: layers.{l}.weight/bias, or "
        "layers.{l}.0.* and layers.{l}.2.* for the MLP)", names_file=True)

    def validate(self) -> None:
        if self.kvzap_weights is not None:
            surrogates_of(self.kvzap_weights)

    def check(self, config) -> None:
        super().check(config)
        if self.kvzap_weights is None:
            raise ConfigError("--method kvzap needs --kvzap_weights FILE (per-layer surrogates in kvpress' KVzapModel "
                              "layout, e.g. a local copy of nvidia/KVzap-mlp-<model>'s model.safetensors)")

    def check_model(self, config, model) -> None:
        layers = surrogates_of(self.kvzap_weights)
        check_weights_fit("--kvzap_weights", self.kvzap_weights, "surrogates", len(layers), layers[0][-1][0].shape[0],
                          model)
        first = "layers.0.weight" if len(layers[0]) == 1 else "layers.0.0.weight"
        check_shape("--kvzap_weights", self.kvzap_weights, first, layers[0][0][0].shape, (None, model.hidden_size))

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        surrogate = layer_weights("--kvzap_weights", self.kvzap_weights, "surrogates", surrogates_of(self.kvzap_weights),
                                  ctx.layer_idx)
        output = ctx.hidden.float()
        for index, (weight, bias) in enumerate(surrogate):
            if index:
                output = torch.nn.functional.gelu(output)
            output = torch.nn.functional.linear(output, weight.to(output.device), bias.to(output.device))
        if output.shape[-1] != ctx.num_kv_heads:
            raise ConfigError(f"--kvzap_weights {self.kvzap_weights}: layer {ctx.layer_idx} predicts "
                              f"{output.shape[-1]} KV heads; the model has {ctx.num_kv_heads}")
        return output.transpose(1, 2)  # [B, H_kv, N]


def surrogates_of(path: str) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per layer, the ``(weight, bias)`` of each linear map of its surrogate (1: linear, 2: MLP)."""
    return read_file_once(path, "--kvzap_weights", _read_surrogates)


def _read_surrogates(path: str) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    tensors = load_safetensors(path, "--kvzap_weights")
    layers = []
    while True:
        prefix = f"layers.{len(layers)}."
        names = [f"{prefix}weight"] if f"{prefix}weight" in tensors else [f"{prefix}0.weight", f"{prefix}2.weight"]
        if not all(name in tensors and name.replace("weight", "bias") in tensors for name in names):
            break
        layers.append([(name, name.replace("weight", "bias")) for name in names])
    if not layers or len(layers) * 2 < sum(name.endswith("weight") for name in tensors):
        raise ConfigError(f"--kvzap_weights {path!r} holds no KVzapModel layers (layers.{{l}}.weight and .bias, or "
                          "layers.{l}.0.* and layers.{l}.2.*)")
    floats = finite_floats("--kvzap_weights", path, {name: tensors[name] for layer in layers for pair in layer
                                                     for name in pair})
    surrogates = [[(floats[weight], floats[bias]) for weight, bias in layer] for layer in layers]
    for layer, maps in zip(layers, surrogates):
        _check_maps(layer, maps, surrogates[0])
    return surrogates


def _check_maps(names: list[tuple[str, str]], maps: list[tuple[torch.Tensor, torch.Tensor]],
                first: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """A layer's maps chain (each weight ``[out, in]``, its bias ``[out]``, one's out the next one's
    in) and read and predict as many numbers as the first layer's (``ValueError`` naming the tensor)."""
    width = first[0][0].shape[-1]
    for (weight_name, bias_name), (weight, bias) in zip(names, maps):
        if weight.dim() != 2 or weight.shape[1] != width:
            raise ValueError(f"{weight_name} is {list(weight.shape)}; it must read {width} numbers: [*, {width}]")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"{bias_name} is {list(bias.shape)}; {weight_name} needs [{weight.shape[0]}]")
        width = weight.shape[0]
    if width != first[-1][0].shape[0]:
        raise ValueError(f"{names[-1][0]} predicts {width} KV heads; layers.0 predicts {first[-1][0].shape[0]}")
