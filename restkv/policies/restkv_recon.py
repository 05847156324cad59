"""ReST-KV for a context compressed before its question (``--method restkv_recon``): a preset of ``restkv``.

ReST-KV's output-change score is read under the queries of the model repeating the context (KVzip's
observation, ``restkv.integrations.transformers.deferred``) instead of the context's last tokens, which
say little about a question that comes later; the budget is spread by one ranking of every (layer, KV
head, token) score (``--allocation model_ranked``), and the scores are not smoothed along positions
(``--pooling none``). Each of the three is what the held-out ablation of ``docs/methods/restkv.md``
("ReST-KV before the question") chose: with ReST-KV's own uniform per-head budget or window queries it
keeps little a later question needs, and the adaptive kernel, whose drift statistic reads a window the
repetition does not have, blurs the exact tokens a repetition copies. Every other option is ReST-KV's
and may be changed as on ``--method restkv``.
"""

from __future__ import annotations

from dataclasses import dataclass

from restkv.config.options import redeclared, register
from restkv.policies.restkv import RestKV


@register("method")
@dataclass(frozen=True)
class RestKVRecon(RestKV):
    name = "restkv_recon"
    reference = RestKV.reference
    allocation = "model_ranked"
    default_observation = "reconstruction"

    pooling: str = redeclared(RestKV, "pooling", "none")
