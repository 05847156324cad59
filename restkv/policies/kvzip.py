"""KVzip (Kim et al., NeurIPS 2025, arXiv 2505.23416): query-agnostic scores from context reconstruction.

After the context's prefill the model is asked to repeat it (``--observation
reconstruction``, the method's default; ``restkv.integrations.transformers.deferred``); a cached token's score is the
largest attention any reconstruction query gives it, the query group pooled by its maximum
(``--gqa_score_agg max``). The first ``--n_sink`` tokens are always kept (attention sinks;
``--n_sink`` must stay below the budget, fixed or of each row under a ratio, else it is an error)
and no recent window is protected: the context is compressed once, for any later question.
The budget is spread by one ranking of every (layer, KV head, token) score across the model
(``--max_capacity_prompts`` x layers x KV heads entries in all, ragged per layer and head);
``--kvzip_layerwise`` ranks the heads of each layer apart instead (every layer keeps the same
total).

Where this differs from the paper and from kvpress' ``KVzipPress``:

* the reconstruction runs as the reference runs it (``restkv.integrations.transformers.deferred``): chunks of
  ``--reconstruction_chunk`` context tokens (default 2048, kvpress's; the reference's 2000),
  each after its instruction (a later one quotes the previous chunk's last 8 tokens), each
  attending to the whole context and its own repetition, whose K/V is dropped after it; a
  chunk's scores are its softmax over the sinks (the template before the context span, else
  the first ``--n_sink`` tokens; the reference's sinks are its system prompt, kvpress's its
  first 4 tokens), the chunk and the repetition;
* evicted entries are removed from memory (ragged per head), where kvpress masks them;
  the paper's own code stores a head-variable cache too;
* the paper's score also covers the system prompt and template tokens; here they are part
  of the context like any other token.

With ``--prefill_chunk_size N`` the context is read, reconstructed and ranked chunk by chunk
(``restkv.integrations.transformers.deferred``): each chunk's repetition attends to what earlier chunks kept, and the
kept tokens' scores are ranked again beside the new chunk's, so the cache never holds more than
the budget plus one chunk and one repetition (a single-pass reconstruction holds the whole
context).

``--kvzip_plus`` is KVzip+ (kvpress' ``kvzip_plus_normalization``, the target of its KVzap): each
reconstruction query's attention is divided by the norm of its hidden state (the attention's
input) before the maximum, and each token's maximum, per query head, multiplied by
``||v W_o^h||_2``, what its value adds to the output; then the group maximum.

On a model with sliding-window layers (Gemma 2/3, sliding Mistral) only the global layers are
scored and pruned, as the reference does: a sliding layer keeps its window, as the model does,
and the global layers alone share the model-wide budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import option, redeclared, register
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import GroupedScores, KeepsSinks
from restkv.scoring.output_space import head_grams

#: the score of a sink token: above any attention weight, so sinks always rank first
SINK_SCORE = 2.0


@register("method")
@dataclass(frozen=True)
class KVzip(KeepsSinks, GroupedScores):
    name = "kvzip"
    reference = "KVzip: Kim et al., NeurIPS 2025, arXiv 2505.23416"
    allocation = "model_ranked"
    default_observation = "reconstruction"

    gqa_score_agg: str = redeclared(GroupedScores, "gqa_score_agg", "max")
    kvzip_layerwise: bool = option(
        False, "KVzip: rank the KV heads of each layer apart (every layer keeps the same total) instead of one "
        "ranking across all layers"
    )
    kvzip_plus: bool = option(
        False, "KVzip+: divide each reconstruction query's attention by its hidden state's norm and weight each "
        "token by its value's norm through each query head's slice of o_proj"
    )

    @property
    def divides_by_hidden_norm(self) -> bool:
        return self.kvzip_plus

    def own_allocation(self) -> str:
        return "layer_ranked" if self.kvzip_layerwise else "model_ranked"

    def protected_count(self, window_size: int, budget: int) -> int:
        return 0

    def check(self, config) -> None:
        super().check(config)
        self.check_sinks(config)

    @property
    def weighs_by_output(self) -> bool:
        """Whether each token's largest attention is multiplied by ``||v W_o||_2`` (KVzip+, KVgrad)."""
        return self.kvzip_plus

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        maximum = ctx.observation.maximum()  # [B, H, N]; KVzip+ (KVgrad): of the attention / ||h|| (x ||dPhi/da||)
        if not self.weighs_by_output:
            return self.mark_sinks(ctx, self.reduce(ctx, maximum), SINK_SCORE)
        weighted = maximum * value_output_norms(ctx)
        return self.mark_sinks(ctx, self.reduce(ctx, weighted), torch.finfo(torch.float32).max)


def value_output_norms(ctx: LayerInputs) -> torch.Tensor:
    """``[B, H, N]`` ``||v_i W_o^h||_2`` of each token's value through each query head's slice of
    ``o_proj`` (``v^T Gamma_h v``, no ``N x hidden`` product)."""
    grams = head_grams(ctx)  # [H_kv, G, d, d]
    values = ctx.value.float()
    squared = torch.einsum("bknd,kgde,bkne->bkgn", values, grams, values).clamp_min(0)
    return squared.sqrt().flatten(start_dim=1, end_dim=2)
