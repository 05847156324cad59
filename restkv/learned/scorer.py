"""Weights of a learned token scorer: per layer and KV head, a linear map from what the prefill
already holds to a query-agnostic score's logarithm (``--method learned_zip``).

The features of a token, for each KV head, are its key before RoPE, its value and a constant 1
(``2 d + 1`` numbers; ``features``). The key is taken before RoPE so that one weight vector
serves every position; both key and value are linear in the layer's input, so the scorer is a
linear function of the hidden state seen through that head. Each ``(layer, head)`` is fitted by
ridge regression on the logarithm of the target scores (``LeastSquares``: a QR factor of
every training token's features, updated as they come, then one solve; ``ridge 0`` gives the
least-squares solution of minimum norm, so a head that has seen no more tokens than it has
features is fitted exactly). ``python -m restkv.tools.train_scorer`` collects the targets.

File format (``torch.save`` of a dict; ``save`` and ``load_weights``): ``format``
(``WEIGHTS_FORMAT``), ``weight`` ``[layers, KV heads, 2 d + 1]`` float32, ``target`` (the
scores it predicts, e.g. ``kvzip``), ``training`` (how it was made: model, text, sequences,
tokens, ridge, fit error, and the held-out report: per held-out text type, the recall of the
target's top scores and the n-gram overlap with the training text; ``held_out``). The trainer
writes no weights without that report (``missing_held_out``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from restkv.config.options import ConfigError
from restkv.files.reading import read_payload

WEIGHTS_FORMAT = "restkv-learned-scorer-1"
#: the weights the package ships, for the embedded default model (how they were made: README)
SHIPPED_WEIGHTS = Path(__file__).parent / "weights" / "learned_zip_smollm2-135m.pt"


def features(pre_rope_key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``[B, H_kv, N, 2 d + 1]`` float32: each token's pre-RoPE key, value and a 1, per KV head."""
    ones = torch.ones(*value.shape[:-1], 1, dtype=torch.float32, device=value.device)
    return torch.cat([pre_rope_key.float(), value.float(), ones], dim=-1)


@dataclass(frozen=True)
class ScorerWeights:
    """A fitted scorer (see the module docstring)."""

    weight: torch.Tensor  # [layers, KV heads, 2 d + 1]
    target: str
    training: dict = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(layers, KV heads, head dim)`` the weights were fitted for."""
        layers, heads, width = self.weight.shape
        return layers, heads, (width - 1) // 2

    @property
    def held_out(self) -> dict[str, dict]:
        """Per held-out text type, what the trainer measured there (``recall``, ``token_overlap``,
        ``word_overlap``); empty for weights made before the held-out protocol."""
        return dict(self.training.get("held_out", {}))

    def predict(self, layer_idx: int, pre_rope_key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``[B, H_kv, N]`` float32 predicted log-scores of layer ``layer_idx``'s tokens."""
        return self.predict_from(layer_idx, features(pre_rope_key, value))

    def predict_from(self, layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        """``[..., H_kv, N]`` predicted log-scores from the tokens' ``features`` ``[..., H_kv, N, p]``."""
        return torch.einsum("...hnp,hp->...hn", x, self.weight[layer_idx].to(x.device))


class LeastSquares:
    """Every ``(layer, KV head)``'s least-squares problem, folded in as it comes: the triangular
    factor ``R`` and ``Q^T y`` of a QR decomposition of all its rows so far (float64; updated
    by the QR of ``[R; X]``, so the fit never squares the features' condition number, as
    ``X^T X`` would), and ``|y|^2``."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        width = 2 * head_dim + 1
        self.factor = torch.zeros(num_layers, num_kv_heads, width, width, dtype=torch.float64)
        self.projected = torch.zeros(num_layers, num_kv_heads, width, dtype=torch.float64)
        self.target_square = torch.zeros(num_layers, num_kv_heads, dtype=torch.float64)
        self.tokens = torch.zeros(num_layers, num_kv_heads, dtype=torch.long)

    def add(self, layer_idx: int, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> None:
        """Fold in one row's tokens: ``x`` ``[H_kv, N, p]`` features, ``y`` ``[H_kv, N]`` log-scores,
        ``mask`` ``[H_kv, N]`` bool (the tokens that count: scored, not sinks or template)."""
        mask = mask.cpu()
        x = x.double().cpu() * mask[..., None]  # a masked token is a zero row: it changes nothing
        y = y.double().cpu() * mask
        rows = torch.cat([self.factor[layer_idx], x], dim=1)
        targets = torch.cat([self.projected[layer_idx], y], dim=1)
        q, self.factor[layer_idx] = torch.linalg.qr(rows)
        self.projected[layer_idx] = (q.transpose(-1, -2) @ targets[..., None]).squeeze(-1)
        self.target_square[layer_idx] += y.square().sum(dim=-1)
        self.tokens[layer_idx] += mask.sum(dim=-1)

    def solve(self, ridge: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights ``[layers, KV heads, p]`` float32 minimising squared error plus ``ridge`` times
        the mean feature energy times ``|w|^2`` (ridge 0: the minimum-norm least-squares solution),
        and each head's mean squared error on the training tokens ``[layers, KV heads]``."""
        layers, heads, width, _ = self.factor.shape
        energy = self.factor.square().sum(dim=(-1, -2)) / width  # trace(X^T X) / p
        penalty = (ridge * energy).sqrt()[..., None, None] * torch.eye(width, dtype=torch.float64)
        system = torch.cat([self.factor, penalty], dim=-2)
        targets = torch.cat([self.projected, torch.zeros(layers, heads, width, dtype=torch.float64)], dim=-1)
        weight = torch.linalg.lstsq(system, targets[..., None], driver="gelsd").solution.squeeze(-1)
        # |Xw - y|^2 = |Rw - Q^T y|^2 + |y|^2 - |Q^T y|^2
        fit = (self.factor @ weight[..., None]).squeeze(-1) - self.projected
        error = fit.square().sum(dim=-1) + self.target_square - self.projected.square().sum(dim=-1)
        return weight.float(), (error.clamp(min=0) / self.tokens.clamp(min=1)).float()


def missing_held_out(weights: ScorerWeights, types: list[str]) -> list[str]:
    """The ``types`` whose held-out report ``weights`` lack (all of them when none is asked: a report needs one)."""
    if not types:
        return ["any held-out type"]
    needed = ("recall", "token_overlap", "word_overlap")
    return [name for name in types if not all(key in weights.held_out.get(name, {}) for key in needed)]


def save(path: str | Path, weights: ScorerWeights) -> None:
    torch.save({"format": WEIGHTS_FORMAT, "weight": weights.weight.contiguous(), "target": weights.target,
                "training": weights.training}, Path(path))


def load_weights(path: str | Path, flag: str = "--learned_zip_weights") -> ScorerWeights:
    """Read a file ``save`` wrote; anything else is a ``ConfigError`` naming ``flag``."""
    payload = read_payload(path, flag, "restkv.tools.train_scorer", (WEIGHTS_FORMAT,), "a learned scorer's")
    weight = payload.get("weight")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or weight.shape[-1] % 2 != 1:
        raise ConfigError(f"{flag} {str(path)!r}: damaged weights (expected [layers, KV heads, 2 x head dim + 1])")
    if not bool(torch.isfinite(weight).all()):
        raise ConfigError(f"{flag} {str(path)!r}: damaged weights (not finite)")
    return ScorerWeights(weight.float(), str(payload.get("target", "")), dict(payload.get("training", {})))
