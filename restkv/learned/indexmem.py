"""IndexMem's learnable parts: a per-layer indexer and a latent memory of the evicted tokens.

IndexMem (arXiv 2605.25475) replaces heuristic eviction scores with a small learned
*indexer* and compensates what eviction loses with a *latent memory*: a compact state,
written from the evicted tokens, read out as a gated residual outside the softmax,
``o = o_attn + g(q) m(q)`` (``g -> 0`` is plain eviction). The paper's code is not public;
this follows the method as readers of its full text report it, and keeps earlier readings (the
``dsa`` indexer, the shared-softmax fusion) behind options. Per layer (``IndexMemLayer``):

* **Indexer** (per KV head, on the model's post-RoPE queries and keys, so it needs no hidden
  state: ``k_proj`` is already a projection of it). ``dot`` form (as reported):
  ``I = tau <n(q W_q), n(k W_k)>`` with L2 normalisation ``n`` (``normalize``; off, identity maps
  and ``tau`` = the attention scale give the model's own window attention, SnapKV's score);
  ``dsa`` form (DeepSeek's sparse-attention indexer):
  ``I = tau sum_u w_u(q) ReLU(<n(q W_q^u), n(k W_k)>)`` with ``w_u(q) = q . a_u``. The score of
  key ``j`` is ``softmax_j(I)`` over the keys each observation query sees, reduced over the
  queries (mean, max or last) and over the query group.
* **Memory** (per KV head), on the pre-RoPE keys and queries (``Architecture.memory_inputs``;
  as the paper is reported, the memory carries no position, so it does not compete with the real
  keys' RoPE; ``post_rope`` reads the rotated ones, what the training-free fallback needs, its
  features estimating the attention logits): positive features
  ``phi(x) = exp(W x~ - |x~|^2 / 2) / sqrt(F)`` with
  ``x~ = sqrt(scale) P x`` (``P = I`` and ``W`` Gaussian make ``phi(q) . phi(k)`` an unbiased
  estimate of ``exp(scale <q, k>)``, Performer's positive random features; training learns
  both). Write: ``M = sum_e w_e phi(k_e) v_e^T``, ``b = sum_e w_e phi(k_e)`` with
  ``w_e = eta lambda^age`` (learned write rate ``eta`` and decay ``lambda``; ``age`` = tokens
  between the evicted token and the end of the prompt). Read: ``m(q) = phi(q)^T M / phi(q)^T b``
  and the estimated evicted mass ``Z_E(q) = phi(q)^T b``.
* **Fusion**: ``residual`` (the paper as reported): ``o + g(q) m(q)``, ``g(q) = sigmoid(q . c_h + c0_h)``
  learned per query head, on the query the memory reads; ``shared_softmax`` (not the paper's,
  the training-free fallback's): the evicted mass joins the softmax,
  ``(N_M + Z_E m) / (Z_M + Z_E) = o + g (m - o)`` with ``g = Z_E / (Z_M + Z_E)`` from the
  log-sum-exp of the exact logits.

The state is stored as ``log_mass = log b`` ``[B, H_kv, F]`` and ``feature_values = M / b``
``[B, H_kv, F, d]`` (float32), which keeps the read stable (a softmax over features) however
large the features get: ``F (d + 1)`` numbers per row and KV head, counted against the budget
in token slots of the cache's key+value bytes (``MemoryState.token_slots``).

The cache and the compression pipeline hold post-RoPE keys and queries; a ``pre_rope`` memory
is written from ``pre_rope_key`` (``restkv.policies.indexmem.IndexMem.summarise``) and read with
``pre_rope_query`` (``MemoryState.correct``), both from ``restkv.scoring.rope``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from restkv.cache.segments.memory import MemoryState
from restkv.config.options import ConfigError
from restkv.files.reading import read_payload
from restkv.scoring.window import key_visibility, window_attention

#: the file format ``IndexMemWeights.save`` writes and ``load_weights`` accepts
WEIGHTS_FORMAT = "restkv-indexmem-v2"


#: the earlier format, still read (its memories were all trained on post-RoPE keys and queries)
POST_ROPE_FORMAT = "restkv-indexmem-v1"


INDEXER_FORMS = ("dot", "dsa")


QUERY_REDUCTIONS = ("mean", "max", "last")


FUSIONS = ("residual", "shared_softmax")


#: what the memory and the gate read: the keys and queries before RoPE (the paper) or after it
MEMORY_INPUTS = ("pre_rope", "post_rope")


#: decay logit of a memory that forgets nothing (lambda = 1 exactly: logsigmoid(inf) = 0)
NO_DECAY = float("inf")


@dataclass(frozen=True)
class Architecture:
    """The shapes and forms of one set of IndexMem weights (what a weights file records)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    features: int = 32
    indexer_form: str = "dot"
    indexer_heads: int = 1
    indexer_dim: int | None = None
    normalize: bool = True
    fusion: str = "residual"
    memory_inputs: str = "pre_rope"

    @property
    def index_dim(self) -> int:
        return self.indexer_dim or self.head_dim


class IndexMemLayer(torch.nn.Module):
    """One layer's indexer, memory feature map, write rate, decay and gate (see the module docstring)."""

    def __init__(self, arch: Architecture, layer_idx: int = 0, seed: int = 0) -> None:
        super().__init__()
        kv, d, width = arch.num_kv_heads, arch.head_dim, arch.index_dim
        generator = torch.Generator().manual_seed(seed * 100_003 + layer_idx)
        heads = arch.indexer_heads if arch.indexer_form == "dsa" else 1
        identity = torch.eye(d, width)
        # Identity projections (the dsa heads start apart), so the indexer starts from window attention.
        query_maps = identity.expand(kv, heads, d, width).clone()
        if heads > 1:
            query_maps += 0.1 * torch.randn(kv, heads, d, width, generator=generator)
        self.index_query = torch.nn.Parameter(query_maps)
        self.index_key = torch.nn.Parameter(identity.expand(kv, d, width).clone())
        self.index_head_weights = torch.nn.Parameter(torch.zeros(kv, heads, d))
        self.index_head_bias = torch.nn.Parameter(torch.ones(kv, heads))
        self.log_temperature = torch.nn.Parameter(torch.tensor(math.log(10.0)))
        self.feature_proj = torch.nn.Parameter(torch.eye(d).expand(kv, d, d).clone())
        self.feature_omega = torch.nn.Parameter(torch.randn(kv, arch.features, d, generator=generator))
        self.decay_logit = torch.nn.Parameter(torch.full((kv,), 12.0))
        self.log_rate = torch.nn.Parameter(torch.zeros(kv))
        self.gate_weight = torch.nn.Parameter(torch.zeros(arch.num_heads, d))
        self.gate_bias = torch.nn.Parameter(torch.full((arch.num_heads,), -4.0))
        self.arch = arch

    @classmethod
    def fallback(cls, arch: Architecture, layer_idx: int, seed: int) -> "IndexMemLayer":
        """The training-free layer: random features of ``exp(scale <q, k>)``, no decay, unit rate,
        so the ``shared_softmax`` read-out estimates the evicted tokens' exact contribution."""
        layer = cls(arch, layer_idx, seed)
        with torch.no_grad():
            layer.decay_logit.fill_(NO_DECAY)
        return layer.requires_grad_(False)

    # ------------------------------------------------------------ indexer
    def importance(self, query: torch.Tensor, key: torch.Tensor, valid: torch.Tensor, num_queries: int,
                   reduction: str = "mean", sliding_window: int | None = None) -> torch.Tensor:
        """``[B, H, N]`` float32: the indexer's ``softmax_j(I)`` of the last ``num_queries`` queries
        ``[B, H, n, d]`` over the keys ``[B, H_kv, N, d]`` they see, reduced over the queries."""
        batch, num_heads, _, d = query.shape
        kv = key.shape[1]
        groups = num_heads // kv
        w = min(num_queries, key.shape[2])
        q = query[:, :, -w:].float().reshape(batch, kv, groups, w, d)
        keys = torch.einsum("bknd,kde->bkne", key.float(), self.index_key)
        queries = torch.einsum("bkgwd,kude->bkugwe", q, self.index_query)
        if self.arch.normalize:
            keys, queries = F.normalize(keys, dim=-1), F.normalize(queries, dim=-1)
        temperature = self.log_temperature.exp()
        if self.arch.indexer_form == "dot":
            scaled = temperature * queries[:, :, 0].reshape(batch, num_heads, w, -1)
            weights = window_attention(scaled, keys, valid, w, 1.0, sliding_window=sliding_window)
        else:
            dots = torch.einsum("bkugwe,bkne->bkugwn", queries, keys).relu()
            head_weights = torch.einsum("bkgwd,kud->bkugw", q, self.index_head_weights)
            head_weights = head_weights + self.index_head_bias[..., None, None]
            logits = temperature * (head_weights[..., None] * dots).sum(dim=2)
            logits = logits.reshape(batch, num_heads, w, -1)
            visible = key_visibility(valid, w, sliding_window)
            weights = torch.softmax(logits.masked_fill(~visible[:, None], torch.finfo(logits.dtype).min), dim=-1)
            weights = weights * valid[:, None, -w:, None]  # padding queries see nothing
        if reduction == "mean":
            return weights.mean(dim=2)
        if reduction == "max":
            return weights.amax(dim=2)
        return weights[:, :, -1]

    # ------------------------------------------------------------ memory
    def log_features(self, x: torch.Tensor, scaling: float) -> torch.Tensor:
        """``log phi(x)`` ``[B, H_kv, n, F]`` of ``x`` ``[B, H_kv, n, d]`` (keys, or a group's queries)."""
        projected = math.sqrt(scaling) * torch.einsum("bknd,kde->bkne", x.float(), self.feature_proj)
        dots = torch.einsum("bkne,kfe->bknf", projected, self.feature_omega)
        return dots - 0.5 * projected.square().sum(dim=-1, keepdim=True) - 0.5 * math.log(self.arch.features)

    def write(self, keys: torch.Tensor, values: torch.Tensor, evicted: torch.Tensor, ages: torch.Tensor,
              scaling: float) -> "MemoryState":
        """The memory of the ``evicted`` ``[B, H_kv, N]`` tokens among ``keys``/``values``
        ``[B, H_kv, N, d]``; ``ages`` ``[N]``: tokens between each column and the prompt's end."""
        log_decay = F.logsigmoid(self.decay_logit)[None, :, None, None]
        log_weight = self.log_rate[None, :, None, None] + ages.float()[None, None, :, None] * log_decay
        logits = (self.log_features(keys, scaling) + log_weight).masked_fill(~evicted[..., None], float("-inf"))
        log_mass = torch.logsumexp(logits, dim=2)  # [B, H_kv, F]
        shares = torch.exp(logits - log_mass[:, :, None]).nan_to_num(0.0)  # a feature with no mass: 0
        return MemoryState(log_mass, torch.einsum("bknf,bknd->bkfd", shares, values.float()), self)

    def read(self, state: "MemoryState", query: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``m(q)`` ``[B, H, q, d]`` and ``log Z_E(q)`` ``[B, H, q]`` for ``query`` ``[B, H, q, d]``."""
        batch, num_heads, q_len, d = query.shape
        kv = state.log_mass.shape[1]
        grouped = query.reshape(batch, kv, num_heads // kv * q_len, d)
        logits = self.log_features(grouped, scaling) + state.log_mass[:, :, None]
        log_mass = torch.logsumexp(logits, dim=-1)
        shares = torch.exp(logits - log_mass[..., None]).nan_to_num(0.0)
        readout = torch.matmul(shares, state.feature_values)
        return readout.view(batch, num_heads, q_len, d), log_mass.view(batch, num_heads, q_len)

    def gate(self, query: torch.Tensor) -> torch.Tensor:
        """``g(q)`` ``[B, H, q]`` of the residual fusion (``query`` as the memory reads it)."""
        return torch.sigmoid(torch.einsum("bhqd,hd->bhq", query.float(), self.gate_weight) + self.gate_bias[:, None])

    def fuse(self, output: torch.Tensor, lse: torch.Tensor, readout: torch.Tensor, log_mass: torch.Tensor,
             query: torch.Tensor, fusion: str) -> torch.Tensor:
        """The corrected output ``[B, H, q, d]`` (float32) from the attention output ``[B, H, q, d]``,
        its log-sum-exp, the memory's read and the ``query`` it read with (the gate's input);
        queries that read no memory keep ``output``."""
        output = output.float()
        if fusion == "residual":
            fused = output + self.gate(query)[..., None] * readout
        else:
            share = torch.sigmoid(log_mass - lse)[..., None]
            fused = output + share * (readout - output)
        return torch.where(torch.isneginf(log_mass)[..., None], output, fused)


# ---------------------------------------------------------------- weights files
@dataclass
class IndexMemWeights:
    """Every layer's trained parts, with the architecture and how they were trained."""

    arch: Architecture
    layers: list[IndexMemLayer]
    training: dict[str, Any]

    def save(self, path: str | Path) -> None:
        payload = {"format": WEIGHTS_FORMAT, "architecture": vars(self.arch), "training": self.training,
                   "layers": [layer.state_dict() for layer in self.layers]}
        torch.save(payload, path)


def load_weights(path: str | Path, flag: str = "--indexmem_weights") -> IndexMemWeights:
    """Read a file ``save`` wrote; anything else is a ``ConfigError`` naming ``flag``."""
    path = Path(path)
    payload = read_payload(path, flag, "restkv.tools.train_indexmem", (WEIGHTS_FORMAT, POST_ROPE_FORMAT), "an IndexMem")
    try:
        earlier = {"memory_inputs": "post_rope"} if payload["format"] == POST_ROPE_FORMAT else {}
        arch = Architecture(**{**payload["architecture"], **earlier})
        if arch.memory_inputs not in MEMORY_INPUTS:
            raise TypeError(f"memory_inputs {arch.memory_inputs!r} is not one of {', '.join(MEMORY_INPUTS)}")
        layers = []
        for index, state in enumerate(payload["layers"]):
            layer = IndexMemLayer(arch, index)
            layer.load_state_dict(state)
            layers.append(layer.requires_grad_(False))
    except (KeyError, TypeError, RuntimeError) as error:
        raise ConfigError(f"{flag} {str(path)!r}: damaged IndexMem weights ({str(error).splitlines()[0]})") from None
    if len(layers) != arch.num_layers:
        raise ConfigError(f"{flag} {str(path)!r}: {len(layers)} layers stored, the architecture says {arch.num_layers}")
    return IndexMemWeights(arch, layers, dict(payload.get("training", {})))
