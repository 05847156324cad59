"""KVCompose (Akulov et al., 2025, arXiv 2509.05165): attention-guided composite tokens, budgets per layer.

After the context's prefill the model reads the context once more (``--observation
reconstruction``, the method's default; no instruction is put before the repetition, as KVCompose
replays the bare context); a token's score is the largest attention any replay query gives it,
averaged over its query group (``--gqa_score_agg mean``), plus the mean of that score over the
layer's KV heads (``--kvcompose_head_mean``: a token many heads read gains in every head;
``--kvcompose_vnorm`` multiplies by the value's norm first).

The budget is spread by layer (``--allocation kvcompose``, the method's own, model-wide): each
layer's *composite* is the mean over its KV heads of their scores sorted in descending order
(position ``i`` of the composite is the ``i``-th best token of an average head); the first
compressed layer's composite is raised to the elementwise maximum over layers (KVCompose keeps
its first layer the largest); one ranking of every layer's composite entries gives each layer the
number of its entries in the model-wide top (the model's budget, ``L x B`` per head). Every head
of a layer keeps that many of its own best tokens (KVCompose's "structured" cache: its heads
hold as many tokens each, so a layer is one dense block). ``--kvcompose_unstructured`` ranks every
head's sorted scores across the model instead, so each (layer, head) keeps its own count (ragged).

As kvpress' ``KVComposePress`` (``agg_task max, agg_group mean, agg_head mean``,
``keep_token_lower_bound 0``): the replay reads the whole context in one forward (its keys twice
over: ``--reconstruction_chunk N`` bounds that, each piece then scored without the others);
kvpress masks the unstructured variant's evicted entries at full memory, here they are removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import option, register
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import GroupedScores


@register("method")
@dataclass(frozen=True)
class KVCompose(GroupedScores):
    name = "kvcompose"
    reference = "KVCompose: Akulov et al., 2025, arXiv 2509.05165"
    allocation = "kvcompose"
    default_observation = "reconstruction"
    repeats_with_instruction = False
    default_reconstruction_chunk = None

    kvcompose_head_mean: bool = option(True, "KVCompose: add to each token's score its mean over the layer's KV heads")
    kvcompose_vnorm: bool = option(False, "KVCompose: multiply each token's score by its value's norm")

    def protected_count(self, window_size: int, budget: int) -> int:
        return 0

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        scores = self.reduce(ctx, ctx.observation.maximum())
        if self.kvcompose_vnorm:
            scores = scores * ctx.value.float().norm(dim=-1)
        if self.kvcompose_head_mean:
            scores = scores + scores.mean(dim=1, keepdim=True)
        return scores
