"""Learned reconstruction scores: KVzip's query-agnostic ranking at the price of one prefill.

KVzip (``--method kvzip``) scores a context by the attention of the model repeating it, one
more forward over the context with twice its keys. ``--method learned_zip`` predicts those
scores instead from what the prefill already holds: per layer and KV head, a linear map of each
token's pre-RoPE key and value to its KVzip score's logarithm (``restkv.learned.scorer``),
fitted by ``python -m restkv.train_scorer --target kvzip`` on the project's training corpus
(``restkv.learned.training_text``), which shares no n-gram with the benchmarks' texts, and judged on
four text types it never saw (``restkv.benchmarks.heldout_text``; the weights carry that report). The
scoring costs one small matrix product per layer; everything else is KVzip's: no observation
window, the first ``--n_sink`` tokens always kept, the template around a given context span kept
(``restkv.integrations.transformers.context_span``), and one ranking of every (layer, KV head, token) across the model
(``--max_capacity_prompts`` x layers x KV heads entries, ragged per layer and head). Under ``--prefill_chunk_size`` the
kept tokens' predicted scores are ranked again beside each new chunk's (``restkv.pipeline.recompress.rank_chunk``): a
token's score is fixed once its key is read, so the ranking is the single pass's, in bounded memory.

``--learned_zip_weights`` names the weights file; without it, the weights shipped for the
embedded default model (``SmolLM2-135M``; README, "learned_zip") are used, and a model of
another shape is refused with the command that trains its own.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from restkv.config.options import ConfigError, option, register
from restkv.learned.scorer import SHIPPED_WEIGHTS, ScorerWeights, load_weights
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import KeepsSinks, Policy
from restkv.policies.kvzip import SINK_SCORE


@register("method")
@dataclass(frozen=True)
class LearnedZip(KeepsSinks, Policy):
    name = "learned_zip"
    reference = "restkv's own: KVzip's ranking (Kim et al., arXiv 2505.23416) predicted by a trained linear scorer"
    allocation = "model_ranked"
    observes_queries = False
    scores_each_token_alone = True
    fitted_to_a_model = True
    needs_rotary = True
    ranks_context_alone = True

    learned_zip_weights: str | None = option(
        None, "learned_zip: weights file (python -m restkv.tools.train_scorer); default: the ones shipped "
              "for SmolLM2-135M",
        names_file=True,
    )

    def protected_count(self, window_size: int, budget: int) -> int:
        return 0

    def check(self, config) -> None:
        super().check(config)
        self.check_sinks(config)
        self.weights()  # a missing or damaged file is refused before any model runs

    def check_model(self, config, model) -> None:
        self.check_shape(model.num_layers, model.num_kv_heads, model.head_dim)

    def check_shape(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        layers, heads, dim = self.weights().shape
        if (layers, heads, dim) != (num_layers, num_kv_heads, head_dim):
            given = f"--learned_zip_weights {self.learned_zip_weights}" if self.learned_zip_weights else (
                "the shipped --learned_zip_weights (SmolLM2-135M's)")
            raise ConfigError(
                f"{given} fit {layers} layers x {heads} KV heads of dimension {dim}; the model has {num_layers} x "
                f"{num_kv_heads} of {head_dim}: train weights for it with python -m restkv.tools.train_scorer "
                "--model_path MODEL --output FILE and give --learned_zip_weights FILE"
            )

    def file_read(self, name: str) -> str | None:
        if name == "learned_zip_weights":
            return self.learned_zip_weights or str(SHIPPED_WEIGHTS)
        return super().file_read(name)

    def weights(self) -> ScorerWeights:
        file = Path(self.file_read("learned_zip_weights"))
        return _cached_weights(str(file.resolve()), file.stat().st_mtime if file.is_file() else 0.0)

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        self.check_shape(ctx.num_layers, ctx.num_kv_heads, ctx.key.shape[-1])
        key = ctx.pre_rope_key
        # Predicted log-scores; KVzip's are attention weights, at most 1.
        scores = self.weights().predict(ctx.layer_idx, key, ctx.value).exp().clamp(max=1.0)
        return self.mark_sinks(ctx, scores, SINK_SCORE)


@functools.lru_cache(maxsize=4)
def _cached_weights(path: str, modified: float) -> ScorerWeights:
    return load_weights(path)
