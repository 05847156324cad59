"""KVzap's surrogates (``--method kvzap``): per layer, a map from the attention's input at a token to
its KVzip log-score for every KV head, in kvpress' ``KVzapModel`` file layout.

A surrogate is one linear map, or two with a GELU between (a two-layer MLP); ``predict`` applies
it to hidden states ``[..., N, D]``. The file (safetensors) holds, per layer ``l``,
``layers.{l}.weight`` ``[H_kv, D]`` and ``layers.{l}.bias`` (linear), or ``layers.{l}.0.weight``
``[hidden, D]``, ``layers.{l}.0.bias``, ``layers.{l}.2.weight`` ``[H_kv, hidden]``,
``layers.{l}.2.bias`` (MLP): what NVIDIA's published surrogates hold, so either loads the other's.
A file ``save_surrogates`` writes also carries, in its metadata, how it was made (``training``:
the text, the fit, the held-out report it cannot be written without).

``fit_linear`` is KVzap's linear surrogate in closed form (ridge regression, an intercept);
``fit_mlp`` trains the MLP with AdamW under a cosine schedule, as KVzap's reference does, on
standardised inputs and targets whose scales are folded into the first and last maps afterwards, so
the file reads raw hidden states. ``python -m restkv.tools.train_kvzap`` collects the targets.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from restkv.config.options import ConfigError
from restkv.files.reading import finite_floats, load_safetensors, read_file_once

#: one layer's surrogate: the ``(weight [out, in], bias [out])`` of each map, a GELU between two
Surrogate = list[tuple[torch.Tensor, torch.Tensor]]
#: the surrogates shipped for the embedded default model (how they were made: the file's metadata)
SHIPPED_SURROGATES = Path(__file__).parent / "weights" / "kvzap_smollm2-135m.safetensors"


def predict(surrogate: Surrogate, hidden: torch.Tensor) -> torch.Tensor:
    """``[..., N, H_kv]`` float32 predicted log-scores of the hidden states ``[..., N, D]``."""
    output = hidden.float()
    for index, (weight, bias) in enumerate(surrogate):
        if index:
            output = torch.nn.functional.gelu(output)
        output = torch.nn.functional.linear(output, weight.to(output.device), bias.to(output.device))
    return output


def save_surrogates(path: str | Path, surrogates: list[Surrogate], training: dict) -> None:
    """Write ``surrogates`` (one per layer) in kvpress' layout, ``training`` in the metadata; a
    ``ValueError`` if ``training`` has no ``held_out`` report (a surrogate is judged on text it never saw)."""
    if not training.get("held_out"):
        raise ValueError(f"{path}: no held-out report in the training record; surrogates are written with one")
    tensors = {}
    for layer, surrogate in enumerate(surrogates):
        names = ["weight"] if len(surrogate) == 1 else ["0.weight", "2.weight"]
        for name, (weight, bias) in zip(names, surrogate):
            tensors[f"layers.{layer}.{name}"] = weight.float().clone()
            tensors[f"layers.{layer}.{name.replace('weight', 'bias')}"] = bias.float().clone()
    save_file(tensors, str(path), metadata={"format": "pt", "training": json.dumps(training)})


def training_record(path: str | Path) -> dict:
    """The ``training`` a file ``save_surrogates`` wrote holds ({} for another's file)."""
    with safe_open(str(path), framework="pt") as handle:
        return json.loads((handle.metadata() or {}).get("training", "{}"))


def surrogates_of(path: str) -> list[Surrogate]:
    """Per layer, the surrogate a ``--kvzap_weights`` file holds (read once while unchanged;
    anything else is a ``ConfigError`` naming the flag)."""
    return read_file_once(path, "--kvzap_weights", _read_surrogates)


def _read_surrogates(path: str) -> list[Surrogate]:
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


def _check_maps(names: list[tuple[str, str]], maps: Surrogate, first: Surrogate) -> None:
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


def fit_linear(hidden: torch.Tensor, targets: torch.Tensor, ridge: float) -> Surrogate:
    """The linear surrogate minimising squared error on ``targets`` ``[T, H_kv]`` from ``hidden``
    ``[T, D]`` plus ``ridge`` times the mean centred feature energy times ``|W|^2`` (the bias free)."""
    x, y = hidden.double(), targets.double()
    x_mean, y_mean = x.mean(dim=0), y.mean(dim=0)
    x, y = x - x_mean, y - y_mean
    gram = x.T @ x
    penalty = ridge * gram.diagonal().mean()
    weight = torch.linalg.lstsq(gram + penalty * torch.eye(gram.shape[0], dtype=gram.dtype), x.T @ y,
                                driver="gelsd").solution.T  # [H_kv, D]
    return [(weight.float(), (y_mean - weight @ x_mean).float())]


def fit_mlp(hidden: torch.Tensor, targets: torch.Tensor, width: int, epochs: int, learning_rate: float,
            batch_size: int, generator: torch.Generator) -> Surrogate:
    """A two-layer GELU MLP of ``width`` units fitted to ``targets`` ``[T, H_kv]`` from ``hidden`` ``[T, D]``
    by AdamW (mean squared error, cosine schedule, gradients clipped to norm 1); deterministic given
    ``generator`` (initial weights, batch order) and the thread count."""
    x_mean, x_scale = hidden.mean(dim=0), hidden.std(dim=0).clamp(min=1e-6)
    y_mean, y_scale = targets.mean(dim=0), targets.std(dim=0).clamp(min=1e-6)
    x, y = (hidden - x_mean) / x_scale, (targets - y_mean) / y_scale
    shapes = [(width, x.shape[1]), (y.shape[1], width)]
    parameters = []
    for rows, columns in shapes:  # torch.nn.Linear's initialisation, drawn from ``generator``
        bound = 1 / math.sqrt(columns)
        parameters += [(torch.rand(rows, columns, generator=generator) * 2 - 1) * bound,
                       (torch.rand(rows, generator=generator) * 2 - 1) * bound]
    parameters = [p.requires_grad_() for p in parameters]
    optimizer = torch.optim.AdamW(parameters, lr=learning_rate)
    steps = epochs * math.ceil(len(x) / batch_size)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    surrogate = [(parameters[0], parameters[1]), (parameters[2], parameters[3])]
    with torch.enable_grad():
        for _ in range(epochs):
            for batch in torch.randperm(len(x), generator=generator).split(batch_size):
                loss = (predict(surrogate, x[batch]) - y[batch]).square().mean()
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(parameters, 1.0)
                optimizer.step()
                schedule.step()
    (first, first_bias), (last, last_bias) = ((w.detach(), b.detach()) for w, b in surrogate)
    first = first / x_scale  # reads raw hidden states: W (h - mean) / scale
    return [(first, first_bias - first @ x_mean), (last * y_scale[:, None], last_bias * y_scale + y_mean)]
