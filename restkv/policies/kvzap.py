"""KVzap (arXiv 2601.07891): KVzip's scores predicted from the hidden states.

KVzip's reconstruction costs a second pass over the context; KVzap trains, per layer, a small
surrogate that reads the attention's input at each token (the hidden state after the layer's
input norm) and predicts the token's KVzip score for every KV head: a linear map, or a two-layer
GELU MLP (``restkv.learned.kvzap``). Scoring is then one small product per layer, in prefill
(and, in the paper, decoding). The recent ``--window_size`` tokens are kept as for every restkv
scorer (``--window_size 0``: none, as kvpress' ``KVzapPress``), and, as it ranks the context as
KVzip does, the template around a given context span is kept whatever its score
(``restkv.integrations.transformers.context_span``). KVzap is meant to run with threshold eviction
(``--dms --dms_threshold T``: keep what the surrogate scores above ``T``).

``--kvzap_weights FILE``: a safetensors file with kvpress' ``KVzapModel`` layout, one module per
layer: ``layers.{l}.weight`` ``[H_kv, D]`` and ``layers.{l}.bias`` (linear), or
``layers.{l}.0.weight`` ``[hidden, D]``, ``layers.{l}.0.bias``, ``layers.{l}.2.weight``
``[H_kv, hidden]``, ``layers.{l}.2.bias`` (MLP). NVIDIA publishes trained surrogates on the Hub
(``nvidia/KVzap-{linear,mlp}-<model>``; this library does not download them: point the flag at a
local copy of their ``model.safetensors``), and ``python -m restkv.tools.train_kvzap`` trains one
here. Without the flag, the surrogates shipped for the embedded default model (``SmolLM2-135M``)
are read, and a model of another shape is refused with the command that trains its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import ConfigError, option, register
from restkv.files.reading import check_shape
from restkv.learned.kvzap import SHIPPED_SURROGATES, predict, surrogates_of
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import Policy, check_weights_fit, layer_weights


@register("method")
@dataclass(frozen=True)
class KVzap(Policy):
    name = "kvzap"
    reference = "KVzap: arXiv 2601.07891"
    observes_queries = False
    scores_each_token_alone = True
    needs_hidden_states = True
    ranks_context_alone = True
    fitted_to_a_model = True

    kvzap_weights: str | None = option(
        None, "KVzap: safetensors file of the per-layer surrogates (kvpress' KVzapModel: layers.{l}.weight/bias, or "
        "layers.{l}.0.* and layers.{l}.2.* for the MLP; python -m restkv.tools.train_kvzap); default: the ones "
        "shipped for SmolLM2-135M", names_file=True)

    def validate(self) -> None:
        if self.kvzap_weights is not None:
            surrogates_of(self.kvzap_weights)

    def check(self, config) -> None:
        super().check(config)
        surrogates_of(self.file_read("kvzap_weights"))  # the shipped file, when none is given

    def file_read(self, name: str) -> str | None:
        if name == "kvzap_weights":
            return self.kvzap_weights or str(SHIPPED_SURROGATES)
        return super().file_read(name)

    def check_model(self, config, model) -> None:
        path = self.file_read("kvzap_weights")
        layers = surrogates_of(path)
        try:
            check_weights_fit("--kvzap_weights", path, "surrogates", len(layers), layers[0][-1][0].shape[0], model)
            first = "layers.0.weight" if len(layers[0]) == 1 else "layers.0.0.weight"
            check_shape("--kvzap_weights", path, first, layers[0][0][0].shape, (None, model.hidden_size))
        except ConfigError as error:
            if self.kvzap_weights:
                raise
            raise ConfigError(f"{error}; the shipped surrogates are SmolLM2-135M's: train surrogates for this model "
                              "with python -m restkv.tools.train_kvzap --model_path MODEL --output FILE and give "
                              "--kvzap_weights FILE") from None

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        path = self.file_read("kvzap_weights")
        surrogate = layer_weights("--kvzap_weights", path, "surrogates", surrogates_of(path), ctx.layer_idx)
        output = predict(surrogate, ctx.hidden)
        if output.shape[-1] != ctx.num_kv_heads:
            raise ConfigError(f"--kvzap_weights {path}: layer {ctx.layer_idx} predicts "
                              f"{output.shape[-1]} KV heads; the model has {ctx.num_kv_heads}")
        return output.transpose(1, 2)  # [B, H_kv, N]
