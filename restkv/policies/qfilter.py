"""Q-Filters (Godey et al., 2025, arXiv 2503.02812): keys scored against a learned direction per head.

A token's score is ``-<f_{l,h}, k_i>``: each layer and KV head has one filter ``f`` (for a
trained model, the principal direction of its queries, estimated offline), and keys that
project strongly against it receive little attention from typical queries. The filters come
from ``--qfilter_file``, a safetensors file holding ``q_filters`` ``[layers, KV heads,
head_dim]``, as kvpress' ``QFilterPress`` stores them; kvpress downloads them from the Hub for
its supported models, which this library does not do (no hub access): point the flag at a
local copy. No attention is read.

Where this differs from kvpress: the recent ``--window_size`` tokens are kept as for every
restkv scorer (kvpress protects none: ``--window_size 0`` reproduces it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import ConfigError, option, register
from restkv.files.reading import check_shape, finite_floats, load_safetensors, read_file_once
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import Policy


@register("method")
@dataclass(frozen=True)
class QFilter(Policy):
    name = "qfilter"
    reference = "Q-Filters: Godey et al., 2025, arXiv 2503.02812"
    observes_queries = False
    scores_each_token_alone = True

    qfilter_file: str | None = option(
        None, "Q-Filters: safetensors file of the filters, a tensor q_filters [layers, KV heads, head_dim]",
        names_file=True)

    def validate(self) -> None:
        if self.qfilter_file is not None:
            filters_of(self.qfilter_file)

    def check(self, config) -> None:
        super().check(config)
        if self.qfilter_file is None:
            raise ConfigError("--method qfilter needs --qfilter_file FILE (a safetensors file holding q_filters "
                              "[layers, KV heads, head_dim])")

    def check_model(self, config, model) -> None:
        check_shape("--qfilter_file", self.qfilter_file, "q_filters", filters_of(self.qfilter_file).shape,
                    (model.num_layers, model.num_kv_heads, model.head_dim))

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        filters = filters_of(self.qfilter_file)
        if filters.shape[0] <= ctx.layer_idx or filters.shape[1:] != (ctx.num_kv_heads, ctx.key.shape[-1]):
            raise ConfigError(
                f"--qfilter_file {self.qfilter_file!r} holds filters {list(filters.shape)}; layer {ctx.layer_idx} of "
                f"this model needs [>{ctx.layer_idx}, {ctx.num_kv_heads}, {ctx.key.shape[-1]}]"
            )
        direction = filters[ctx.layer_idx].to(ctx.key.device)  # [H_kv, d]
        return -(ctx.key.float() * direction[None, :, None, :]).sum(dim=-1)


def filters_of(path: str) -> torch.Tensor:
    """The ``q_filters`` tensor of ``path`` as float32 (read once while the file is unchanged)."""
    return read_file_once(path, "--qfilter_file", _read_filters)


def _read_filters(path: str) -> torch.Tensor:
    filters = load_safetensors(path, "--qfilter_file").get("q_filters")
    if filters is None or filters.dim() != 3:
        raise ValueError("must hold a tensor q_filters [layers, KV heads, head_dim]")
    return finite_floats("--qfilter_file", path, {"q_filters": filters})["q_filters"]
