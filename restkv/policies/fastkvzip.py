"""Fast KVzip (Kim, Han and Yun, 2026, arXiv 2601.17668): KVzip's ranking from a trained gate per layer.

KVzip scores the cache by having the model repeat the context; Fast KVzip trains, per layer, a
small gate on the attention's input that predicts those scores at prefill cost: each KV head
projects a token's hidden state to a 16-dim key and each of its query group to a 16-dim query
(RMS-normed), and compares the token with ``S`` learned sink keys: the score is
``1 / (1 + sum_s exp(q.k_s / 4 - q.k / 4 - b))``, averaged over the group (how much a query
would read the token rather than the sinks). The first ``--n_sink`` tokens and the newest
``--window_size`` are kept (Fast KVzip's window is ``int(0.02 N)``: pass it), and one ranking
across layers and KV heads spreads the model's budget, as KVzip does (``--kvzip_layerwise``:
per layer).

``--fastkvzip_gates FILE``: the trained gates, as the authors release them
(``Jang-Hyun/Fast-KVzip`` on the Hub: a ``.pt`` whose ``"module"`` is one state dict per layer,
read with ``weights_only``), or a safetensors file of ``gate{l}.<parameter>`` tensors. No gate
ships for the embedded model; the hub is not reached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from restkv.config.options import ConfigError, option, register
from restkv.files.reading import check_shape, finite_floats, load_safetensors, read_file_once
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import KeepsSinks, Policy, check_weights_fit, layer_weights

GATE_PARAMETERS = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "q_norm.weight", "k_norm.weight", "k_base", "b")


@register("method")
@dataclass(frozen=True)
class FastKVzip(KeepsSinks, Policy):
    name = "fastkvzip"
    reference = "Fast KVzip: Kim, Han and Yun, 2026, arXiv 2601.17668"
    allocation = "model_ranked"
    observes_queries = False
    scores_each_token_alone = True
    needs_hidden_states = True

    fastkvzip_gates: str | None = option(
        None, "Fast KVzip: the trained gates (the authors' .pt of per-layer state dicts, or safetensors of "
        "gate{l}.<parameter>)", names_file=True)
    kvzip_layerwise: bool = option(False, "KVzip: rank the KV heads of each layer apart (every layer keeps the same "
                                          "total) instead of one ranking across all layers")

    def own_allocation(self) -> str:
        return "layer_ranked" if self.kvzip_layerwise else "model_ranked"

    def validate(self) -> None:
        if self.fastkvzip_gates is not None:
            gates_of(self.fastkvzip_gates)

    def check(self, config) -> None:
        super().check(config)
        self.check_sinks(config)
        if self.fastkvzip_gates is None:
            raise ConfigError("--method fastkvzip needs --fastkvzip_gates FILE (the authors' trained gates for the "
                              "model, e.g. a local copy from Jang-Hyun/Fast-KVzip)")

    def check_model(self, config, model) -> None:
        gates = gates_of(self.fastkvzip_gates)
        check_weights_fit("--fastkvzip_gates", self.fastkvzip_gates, "gates", len(gates), gates[0]["b"].shape[0], model)
        _, sinks, width = gates[0]["k_base"].shape[1:]
        needed = gate_shapes(model.num_kv_heads, model.num_heads // model.num_kv_heads, width, sinks,
                             model.hidden_size)
        for name, shape in needed.items():  # every layer's are layer 0's (checked when read)
            check_shape("--fastkvzip_gates", self.fastkvzip_gates, f"gate0.{name}", gates[0][name].shape, shape)

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        gate = layer_weights("--fastkvzip_gates", self.fastkvzip_gates, "gates", gates_of(self.fastkvzip_gates),
                             ctx.layer_idx)
        scores = gate_scores({name: t.to(ctx.key.device) for name, t in gate.items()}, ctx.hidden.float())
        return self.mark_sinks(ctx, scores, 1.0)  # a gate score lies below 1


def gate_scores(gate: dict[str, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    """``[B, H_kv, N]`` a Fast KVzip gate's scores of the hidden states ``[B, N, D]``."""
    heads, _, groups = gate["b"].shape
    width = gate["q_norm.weight"].shape[0]

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + 1e-6)

    batch, length, _ = hidden.shape
    queries = rms(torch.nn.functional.linear(hidden, gate["q_proj.weight"], gate["q_proj.bias"])
                  .view(batch, length, heads, groups, width), gate["q_norm.weight"])
    keys = rms((hidden @ gate["k_proj.weight"].T).view(batch, length, heads, width), gate["k_norm.weight"])
    scale = math.sqrt(width)
    own = torch.einsum("bnhw,bnhgw->bhng", keys, queries) / scale + gate["b"][None, :, 0, None, :]  # [B, H, N, G]
    sinks = torch.einsum("hsw,bnhgw->bhnsg", gate["k_base"][:, 0], queries) / scale  # [B, H, N, S, G]
    score = 1.0 / (1.0 + (sinks - own[:, :, :, None, :]).exp().sum(dim=3))
    return score.mean(dim=-1)


def gate_shapes(heads: int, groups: int, width: int, sinks: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """The shape of each gate parameter for ``heads`` KV heads of ``groups`` queries each, ``width``-dim
    queries and keys, ``sinks`` learned sink keys and hidden states of ``hidden`` numbers."""
    return {"q_proj.weight": (heads * groups * width, hidden), "q_proj.bias": (heads * groups * width,),
            "k_proj.weight": (heads * width, hidden), "q_norm.weight": (width,), "k_norm.weight": (width,),
            "k_base": (heads, 1, sinks, width), "b": (heads, 1, groups)}


def gates_of(path: str) -> list[dict[str, torch.Tensor]]:
    """Per layer, the gate's parameters (float32), read once while the file is unchanged."""
    return read_file_once(path, "--fastkvzip_gates", _read_gates)


def _read_gates(path: str) -> list[dict[str, torch.Tensor]]:
    if path.endswith(".safetensors"):
        tensors = load_safetensors(path, "--fastkvzip_gates")
        count = len({name.split(".", 1)[0] for name in tensors if name.startswith("gate")})
        layers = [{name: tensors.get(f"gate{layer}.{name}") for name in GATE_PARAMETERS} for layer in range(count)]
    else:
        layers = torch.load(path, map_location="cpu", weights_only=True)["module"]
    complete = [isinstance(layer, dict) and all(layer.get(name) is not None for name in GATE_PARAMETERS)
                for layer in (layers if isinstance(layers, (list, tuple)) else ())]
    if not complete or not all(complete):
        raise ConfigError(f"--fastkvzip_gates {path!r} must hold, per layer, {', '.join(GATE_PARAMETERS)}")
    gates = [finite_floats("--fastkvzip_gates", path, {name: layer[name] for name in GATE_PARAMETERS})
             for layer in layers]
    first = gates[0]
    if first["b"].dim() != 3 or first["k_base"].dim() != 4 or first["k_proj.weight"].dim() != 2:
        raise ValueError("gate0: b must be [KV heads, 1, groups], k_base [KV heads, 1, sinks, width], k_proj.weight "
                         "[KV heads x width, hidden]")
    heads, _, groups = first["b"].shape
    needed = gate_shapes(heads, groups, first["k_base"].shape[-1], first["k_base"].shape[2],
                         first["k_proj.weight"].shape[1])
    for layer, gate in enumerate(gates):
        for name, shape in needed.items():
            if tuple(gate[name].shape) != shape:
                raise ValueError(f"gate{layer}.{name} is {list(gate[name].shape)}; gate 0 makes it {list(shape)}")
    return gates
