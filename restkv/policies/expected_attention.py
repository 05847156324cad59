"""Expected Attention (Devoto et al., 2025, arXiv 2510.00636): the attention future queries are expected to pay.

The prompt's queries model the queries to come (``restkv.policies.future_queries``): their
pre-RoPE mean ``mu`` and covariance ``S`` make a future query Gaussian; rotated by the mean
future rotation ``R``, the expected softmax numerator of key ``k`` is
``exp(s k.R mu + s^2/2 k^T R S R^T k)`` (the Gaussian's moment generating function at ``s k``,
``s`` the layer's attention scale). A token's score is that expected attention, normalised
over the row's tokens after the sinks, averaged over the query group (``--gqa_score_agg``)
and, with ``--ea_vnorm``, multiplied by ``(score + --ea_epsilon) * ||v||`` (what the token adds
to the output, not only how much it is read). ``--no-ea_covariance`` drops the second-order term.
``--ea_stats FILE`` takes ``mu`` and ``S`` of each layer and query head from offline statistics
instead of the prompt (kvpress' ExpectedAttentionStatsPress; ``python -m
restkv.tools.query_stats`` computes them for any model): a safetensors file holding
``query_mean`` ``[L, H, d]`` and ``query_cov`` ``[L, H, d, d]`` of pre-RoPE queries.

Where this differs from kvpress' ``ExpectedAttentionPress``: the statistics are those of each
row's own tokens (kvpress' cover every column of the batch, the same for batch size 1);
``s`` is the layer's own scale (kvpress' ``1/sqrt(d)``, the same for every family but Gemma's
``query_pre_attn_scalar``); the recent ``--window_size`` tokens are kept as for every restkv
scorer (kvpress protects only the sinks: ``--window_size 0`` reproduces it); soft-capping is
not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import ConfigError, option, register
from restkv.files.reading import check_shape, finite_floats, load_safetensors, read_file_once
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.future_queries import FutureQueries


@register("method")
@dataclass(frozen=True)
class ExpectedAttention(FutureQueries):
    name = "expected_attention"
    reference = "Expected Attention: Devoto et al., 2025, arXiv 2510.00636"

    ea_covariance: bool = option(True, "Expected Attention: add the query covariance's second-order term")
    ea_vnorm: bool = option(True, "Expected Attention: weight each score by its value's norm")
    ea_epsilon: float = option(0.0, "Expected Attention: added to each score before the value-norm weighting",
                               minimum=0)
    ea_stats: str | None = option(
        None, "Expected Attention: safetensors file of pre-RoPE query statistics (query_mean [L, H, d], query_cov "
        "[L, H, d, d]; python -m restkv.tools.query_stats) used instead of the prompt's queries", names_file=True)

    def validate(self) -> None:
        if self.ea_stats is not None:
            query_stats_of(self.ea_stats)

    def check_model(self, config, model) -> None:
        if self.ea_stats is not None:  # the covariance's shape follows the mean's (checked when read)
            check_shape("--ea_stats", self.ea_stats, "query_mean", query_stats_of(self.ea_stats)[0].shape,
                        (model.num_layers, model.num_heads, model.head_dim))

    def future_scores(self, ctx, queries, keys, values, rotation):
        scores = self.expected_attention(ctx, queries, keys, rotation)
        return (scores + self.ea_epsilon) * values.norm(dim=-1) if self.ea_vnorm else scores

    def expected_attention(self, ctx: LayerInputs, queries: torch.Tensor, keys: torch.Tensor,
                           rotation: torch.Tensor) -> torch.Tensor:
        """``[H_kv, n]`` the normalised expected attention of ``keys`` ``[H_kv, n, d]`` (post-RoPE)
        under future queries distributed as ``queries`` ``[H, n, d]`` (pre-RoPE), turned by ``rotation``."""
        mean, spread = self.statistics(ctx, queries)  # [H, d], [H, d, d]
        groups = queries.shape[0] // keys.shape[0]
        keys = keys.repeat_interleave(groups, dim=0)  # [H, n, d]
        logits = ctx.scaling * keys @ (mean @ rotation.T)[:, :, None]
        if self.ea_covariance:
            covariance = rotation @ spread @ rotation.T
            logits = logits + ctx.scaling**2 / 2 * ((keys @ covariance) * keys).sum(dim=-1, keepdim=True)
        weights = logits.squeeze(-1).softmax(dim=-1)  # [H, n]
        return ctx.reduce_groups(weights[None], self.gqa_score_agg)[0]

    def statistics(self, ctx: LayerInputs, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The future queries' pre-RoPE mean ``[H, d]`` and covariance ``[H, d, d]``: the prompt's
        (``queries`` ``[H, n, d]``, covariance divided by ``n``) or the ``--ea_stats`` file's."""
        if self.ea_stats is not None:
            mean, cov = query_stats_of(self.ea_stats)
            if ctx.layer_idx >= mean.shape[0] or mean.shape[1:] != queries.shape[::2]:
                raise ConfigError(f"--ea_stats {self.ea_stats} holds statistics {list(mean.shape)}; layer "
                                  f"{ctx.layer_idx} has {queries.shape[0]} query heads of dimension {queries.shape[2]}")
            return mean[ctx.layer_idx].to(queries.device), cov[ctx.layer_idx].to(queries.device)
        mean = queries.mean(dim=1)
        centred = queries - mean[:, None]
        return mean, centred.transpose(1, 2) @ centred / queries.shape[1]


def query_stats_of(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(query_mean, query_cov)`` of the statistics file ``path``, float32 (read once while unchanged)."""
    return read_file_once(path, "--ea_stats", _read_stats)


def _read_stats(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    tensors = load_safetensors(path, "--ea_stats")
    mean, cov = tensors.get("query_mean"), tensors.get("query_cov")
    if mean is None or cov is None or mean.dim() != 3 or tuple(cov.shape) != (*mean.shape, mean.shape[-1]):
        raise ValueError("must hold query_mean [L, H, d] and query_cov [L, H, d, d] (python -m "
                         "restkv.tools.query_stats computes them)")
    stats = finite_floats("--ea_stats", path, {"query_mean": mean, "query_cov": cov})
    _check_covariance(stats["query_cov"])
    return stats["query_mean"], stats["query_cov"]


#: relative tolerance of the covariance checks (float32 statistics of real queries are symmetric and
#: positive semi-definite up to rounding)
COVARIANCE_TOLERANCE = 1e-4


def _check_covariance(cov: torch.Tensor) -> None:
    """A covariance of every layer and head ``[L, H, d, d]`` is symmetric and positive semi-definite
    (its eigenvalues >= 0, up to ``COVARIANCE_TOLERANCE`` of its largest): ``ValueError`` naming the
    first that is not."""
    cov = cov.double()
    scale = cov.abs().amax(dim=(-2, -1)).clamp(min=torch.finfo(torch.float32).tiny)
    asymmetric = (cov - cov.transpose(-2, -1)).abs().amax(dim=(-2, -1)) > COVARIANCE_TOLERANCE * scale
    lowest = torch.linalg.eigvalsh((cov + cov.transpose(-2, -1)) / 2)[..., 0]
    indefinite = lowest < -COVARIANCE_TOLERANCE * scale
    for name, bad in (("not symmetric", asymmetric), ("not positive semi-definite", indefinite)):
        if bool(bad.any()):
            layer, head = (int(i) for i in bad.nonzero()[0])
            detail = f" (an eigenvalue {float(lowest[layer, head]):.3g})" if bad is indefinite else ""
            raise ValueError(f"query_cov of layer {layer}, head {head} is {name}{detail}: not a covariance")
