"""Partial attention: what every segment of a compressed layer returns, and the kernels that compute it.

A compressed layer (``restkv.cache``) is a list of typed segments. Each reads itself as a
*partial* attention of the step's queries (``Probe``): its softmax-normalised output, the
log-sum-exp of its logits and, when a part asks for it, the largest logit. Partials of
disjoint key sets merge exactly by their log-sum-exps (``merge``), as split-K flash decoding
does, so each segment can use its fastest kernel and the layer still computes ONE softmax:

    lse = log(sum_i exp(lse_i)),    output = sum_i exp(lse_i - lse) output_i.

Layout: keys and values stay at ``H_kv`` heads; the ``G`` query heads of a group are stacked
as rows, ``[B, H_kv, G * q, d]`` (row ``g * q + t`` is query ``t`` of query head ``k * G + g``),
so no key is ever repeated per query head.

Kernels (``KERNELS``, chosen by ``kernel_for``; every one is tested against ``reference``):

* ``reference``: the eager float32 softmax, with soft-capping; the definition the others meet.
* ``sdpa``: torch's fused ``scaled_dot_product_attention``; when the log-sum-exp is needed, the
  CPU flash kernel that returns it (``_scaled_dot_product_flash_attention_for_cpu``).
* ``flash``: flash-attn on CUDA (``flash_attn_func`` with the log-sum-exp), for key blocks
  without holes; lazily imported, absent without the ``flash`` extra.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple

import torch
import torch.nn.functional as F

#: the logit of a masked column (finite, so a row with nothing visible never yields NaN)
MASKED = torch.finfo(torch.float32).min


class Partial(NamedTuple):
    """One segment's share of a step's attention (rows are the probe's stacked query rows).

    output: ``[B, H_kv, R, d_v]``, normalised over the segment's own keys (zeros where a row
        sees none). lse: ``[B, H_kv, R]`` float32 log-sum-exp of its logits (``-inf``: nothing
        visible); None from a kernel that was not asked for it. peak: ``[B, H_kv, R]`` float32
        largest visible logit, or None. count: ``[B, H_kv, R]`` visible keys, or None.
    """

    output: torch.Tensor
    lse: torch.Tensor | None = None
    peak: torch.Tensor | None = None
    count: torch.Tensor | None = None


@dataclass
class Probe:
    """The queries of one step, as every segment reads them.

    query: ``[B, H, q, d]`` post-RoPE queries. first_column: the padded-batch column of the first
    query; the others follow (a key at column ``c`` is causal for query ``t`` iff
    ``c <= first_column + t``). sliding_window: keys at or before ``column - sliding_window`` are
    invisible. need_lse / need_peak / need_count: what the layer's merge and summaries read from
    the exact partials. value_heads: ``[H_kv]`` the KV head whose values each KV head's group reads,
    for a module that hands its kernel values of other heads (DiffLlama's half-value calls); None:
    its own.
    """

    query: torch.Tensor
    num_kv_heads: int
    first_column: int
    scaling: float
    softcap: float | None = None
    sliding_window: int | None = None
    need_lse: bool = False
    need_peak: bool = False
    need_count: bool = False
    value_heads: torch.Tensor | None = None
    _stacked: torch.Tensor | None = field(default=None, repr=False)

    @property
    def batch(self) -> int:
        return self.query.shape[0]

    @property
    def q_len(self) -> int:
        return self.query.shape[2]

    @property
    def groups(self) -> int:
        return self.query.shape[1] // self.num_kv_heads

    @property
    def stacked(self) -> torch.Tensor:
        """``[B, H_kv, G * q, d]``: the query heads of each group stacked as rows."""
        if self._stacked is None:
            batch, _, q_len, dim = self.query.shape
            self._stacked = self.query.reshape(batch, self.num_kv_heads, self.groups * q_len, dim)
        return self._stacked

    @property
    def columns(self) -> torch.Tensor:
        """``[q]`` padded-batch column of each query."""
        return torch.arange(self.first_column, self.first_column + self.q_len, device=self.query.device)

    @property
    def masks_by_position(self) -> bool:
        """Whether visibility depends on the query's position (several queries, or a sliding window)."""
        return self.q_len > 1 or self.sliding_window is not None

    def visibility(self, columns: torch.Tensor) -> torch.Tensor:
        """``[B, H_kv | 1, G * q | 1, S]`` bool: which keys at padded-batch ``columns``
        ``[B, H_kv | 1, S]`` (-1: no key) each query row sees (causal, inside the window)."""
        held = columns >= 0
        if not self.masks_by_position:
            return held[:, :, None, :]
        positions = columns[:, :, None, :]
        query = self.columns.to(columns.device)[None, None, :, None]
        seen = held[:, :, None, :] & (positions <= query)
        if self.sliding_window is not None:
            seen = seen & (positions > query - self.sliding_window)
        if self.q_len == 1:
            return seen
        return seen[:, :, None].expand(-1, -1, self.groups, -1, -1).reshape(
            seen.shape[0], seen.shape[1], self.groups * self.q_len, seen.shape[-1])

    def with_queries(self, stacked: torch.Tensor) -> "Probe":
        """The same probe reading other (already stacked) queries: ThinK's kept key channels."""
        probe = Probe(self.query, self.num_kv_heads, self.first_column, self.scaling, self.softcap, self.sliding_window,
                      self.need_lse, self.need_peak, self.need_count)
        probe._stacked = stacked
        return probe

    def interface(self, output: torch.Tensor) -> torch.Tensor:
        """A merged ``[B, H_kv, G * q, d]`` output in the attention interface's ``[B, q, H, d]``."""
        batch, _, q_len, _ = self.query.shape
        return output.reshape(batch, -1, q_len, output.shape[-1]).transpose(1, 2)

    def per_query_head(self, rows: torch.Tensor) -> torch.Tensor:
        """``[B, H_kv, G * q]`` row statistics as ``[B, H, q]``."""
        batch, _, q_len, _ = self.query.shape
        return rows.reshape(batch, -1, q_len)


# ---------------------------------------------------------------- merging
def merge(parts: list[Partial], statistics: bool = True) -> Partial:
    """The partial of the union of disjoint key sets (every part needs its ``lse``); ``statistics``:
    also the merged peak and count (when every part has them)."""
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:  # the second part's share of the mass: sigmoid(lse_b - lse_a)
        first, second = parts
        share = torch.sigmoid(second.lse - first.lse).nan_to_num_(0.0)  # -inf - -inf: a row nobody sees
        output = torch.lerp(first.output.float(), second.output.float(), share[..., None])
        lse = torch.logaddexp(first.lse, second.lse)
    else:
        lse = torch.logsumexp(torch.stack([part.lse for part in parts]), dim=0)
        output = None
        for part in parts:
            term = torch.exp(part.lse - lse).nan_to_num_(0.0)[..., None] * part.output.float()
            output = term if output is None else output + term
    if not statistics:
        return Partial(output, lse)
    peak = None
    if all(part.peak is not None for part in parts):
        peak = functools.reduce(torch.maximum, [part.peak for part in parts])
    count = None
    if all(part.count is not None for part in parts):
        count = sum(part.count for part in parts)
    return Partial(output, lse, peak, count)


def mix_separately(exact: Partial, side: Partial, omega: torch.Tensor) -> Partial:
    """``(1 - omega) o_exact + omega o_side``: a summary normalised apart from the exact tokens
    (the separate-softmax ablations of ResKV and MomentKV); ``omega`` ``[B, H_kv, R]``."""
    omega = omega[..., None]
    return Partial((1.0 - omega) * exact.output.float() + omega * side.output.float(), exact.lse, exact.peak,
                   exact.count)


# ---------------------------------------------------------------- kernels
Kernel = Callable[[Probe, torch.Tensor, torch.Tensor, "torch.Tensor | None"], Partial]
KERNELS: dict[str, Kernel] = {}
_FORCED: list[str] = []


def register_kernel(name: str) -> Callable[[Kernel], Kernel]:
    """Register a read kernel: ``kernel(probe, keys, values, visible) -> Partial`` over one block of
    keys/values ``[B, H_kv, S, d]`` with ``visible`` ``[B, H_kv | 1, R | 1, S]`` bool (None: all)."""

    def add(kernel: Kernel) -> Kernel:
        KERNELS[name] = kernel
        return kernel

    return add


@contextlib.contextmanager
def use_kernel(name: str) -> Iterator[None]:
    """Read every segment with kernel ``name`` inside the block (tests compare each with ``reference``)."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; registered: {', '.join(sorted(KERNELS))}")
    _FORCED.append(name)
    try:
        yield
    finally:
        _FORCED.pop()


def kernel_for(probe: Probe, keys: torch.Tensor, visible: torch.Tensor | None) -> Kernel:
    """The kernel that reads ``keys`` for ``probe``: the forced one (``use_kernel``), the
    reference for soft-capped logits (no fused kernel caps), flash on CUDA where it can express
    the mask, else torch's SDPA."""
    if _FORCED:
        return KERNELS[_FORCED[-1]]
    if probe.softcap is not None:
        return KERNELS["reference"]
    if keys.is_cuda and visible is None and "flash" in KERNELS and keys.dtype in (torch.float16, torch.bfloat16):
        return KERNELS["flash"]
    return KERNELS["sdpa"]


def attend_block(probe: Probe, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None) -> Partial:
    """One block of keys read by the kernel ``kernel_for`` picks, with what the probe asks for."""
    return kernel_for(probe, keys, visible)(probe, keys, values, visible)


def _counts(probe: Probe, keys: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor | None:
    if not probe.need_count:
        return None
    rows = probe.stacked.shape[2]
    if visible is None:
        return torch.full((keys.shape[0], keys.shape[1], rows), keys.shape[2], device=keys.device)
    return visible.sum(dim=-1).expand(keys.shape[0], keys.shape[1], rows)


def softmax_partial(logits: torch.Tensor, values: torch.Tensor, peak: bool = True) -> Partial:
    """The partial of float32 ``logits`` ``[..., R, S]`` (``-inf`` where masked) over ``values``
    ``[..., S, d]``: output, log-sum-exp and (``peak``) the largest logit; a row that sees
    nothing gives zeros and ``-inf``."""
    lse = torch.logsumexp(logits, dim=-1)
    weights = torch.exp(logits - lse[..., None]).nan_to_num_(0.0)
    output = torch.matmul(weights, values.float())
    return Partial(output, lse, logits.amax(dim=-1) if peak else None)


def scaled_logits(probe: Probe, keys: torch.Tensor) -> torch.Tensor:
    """``[B, H_kv, R, S]`` float32 ``scaling <q, k>`` of the probe's rows (soft-capped if the model caps):
    the dot products in the model dtype, as transformers' eager attention computes them."""
    logits = torch.matmul(probe.stacked, keys.transpose(-1, -2)).float() * probe.scaling
    if probe.softcap is not None:
        logits = torch.tanh(logits / probe.softcap) * probe.softcap
    return logits


@register_kernel("reference")
def reference_kernel(probe: Probe, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None) -> Partial:
    """The eager float32 softmax over one block: the definition every other kernel meets."""
    logits = scaled_logits(probe, keys)
    if visible is not None:
        logits = logits.masked_fill(~visible, float("-inf"))
    return softmax_partial(logits, values)._replace(count=_counts(probe, keys, visible))


def _peak(probe: Probe, keys: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    """The largest visible logit of each row (what the ResKV gate reads), for kernels that do not return it."""
    logits = torch.matmul(probe.stacked, keys.transpose(-1, -2)).float()
    if visible is not None:
        logits = logits.masked_fill(~visible, float("-inf"))
    return logits.amax(dim=-1) * probe.scaling


def _unseen(lse: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    """``lse`` with ``-inf`` for rows that see no key (the fused kernels report 0 there)."""
    if visible is None:
        return lse
    return lse.masked_fill(~visible.any(dim=-1).expand_as(lse), float("-inf"))


@register_kernel("sdpa")
def sdpa_kernel(probe: Probe, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None) -> Partial:
    """torch's fused attention; with ``probe.need_lse`` the CPU flash kernel that returns the
    log-sum-exp (other devices: the reference, which computes it)."""
    if not probe.need_lse:
        output = F.scaled_dot_product_attention(probe.stacked, keys, values, attn_mask=visible, scale=probe.scaling)
        return Partial(output)
    if keys.device.type != "cpu" or keys.shape[-1] != values.shape[-1]:
        return reference_kernel(probe, keys, values, visible)
    mask = None
    if visible is not None:
        mask = torch.zeros(visible.shape, dtype=keys.dtype, device=keys.device).masked_fill_(~visible, float("-inf"))
    output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        probe.stacked, keys, values, 0.0, False, attn_mask=mask, scale=probe.scaling)
    peak = _peak(probe, keys, visible) if probe.need_peak else None
    return Partial(output, _unseen(lse.float(), visible), peak, _counts(probe, keys, visible))


def _flash_kernel(probe: Probe, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None) -> Partial:
    """flash-attn over a block without a mask (one query per row: ``kernel_for`` hands it no
    visibility, which only a single decode query without a window has): the stacked rows are the
    query heads of one position, flash maps each to its KV head, and returns the log-sum-exp."""
    from flash_attn import flash_attn_func

    batch, heads, rows, dim = probe.stacked.shape
    output, lse, _ = flash_attn_func(
        probe.stacked.reshape(batch, 1, heads * rows, dim), keys.transpose(1, 2), values.transpose(1, 2),
        softmax_scale=probe.scaling, return_attn_probs=True)
    stacked_output = output.reshape(batch, heads, rows, values.shape[-1])
    stacked_lse = lse[..., :1].reshape(batch, heads, rows).float()
    peak = _peak(probe, keys, None) if probe.need_peak else None
    return Partial(stacked_output, stacked_lse if probe.need_lse else None, peak, _counts(probe, keys, None))


try:  # the CUDA kernel exists only with flash-attn installed (the ``flash`` extra)
    import flash_attn  # noqa: F401
except ImportError:
    pass
else:
    register_kernel("flash")(_flash_kernel)


# ---------------------------------------------------------------- the shared workspace
_WORKSPACES: dict[tuple, torch.Tensor] = {}


def workspace(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reused scratch tensor of ``shape`` (grown when needed, shared by every layer): where a
    quantised block is dequantised before a kernel reads it, so no full-precision copy of a
    layer outlives the read."""
    key = (name, dtype, str(device))
    size = 1
    for extent in shape:
        size *= extent
    buffer = _WORKSPACES.get(key)
    if buffer is None or buffer.numel() < size:
        buffer = _WORKSPACES[key] = torch.empty(size, dtype=dtype, device=device)
    return buffer[:size].view(shape)
