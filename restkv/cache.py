"""The compressed cache layer and cache-wide reports.

A compressed layer replaces a ``DynamicLayer`` (or ``DynamicSlidingWindowLayer``) in the
model's ``Cache`` after the prefill has been compressed. It holds three segments that
take part in one softmax (``restkv.attention.attend_segments``):

* **kept**: the selected prompt tokens, ``[B, H_kv, K, d]`` per KV head (never repeated per
  query head). Rows and heads may keep different counts; slots are padded only up to the
  largest count in the layer and marked by ``kept_columns == -1``.
* **residual**: summary entries of evicted tokens (ResKV, ``restkv.residual``). They live in
  the last ``R`` slots of the kept tensors (a head with ``r`` entries keeps ``m = b - r``
  tokens in its first slots and its entries in its last ``r``), so a layer holds exactly the
  base method's slots; ``residual_log_counts`` ``[B, H_kv, R]`` (float32 ``log c``, ``-inf``
  where the slot holds no entry) marks them, and ``residual_readout`` says how attention reads
  them (count exponent, gate, shared or separate softmax). None without ``--residual``.
* **tail**: tokens appended after compression (question chunk, generated tokens), dense
  ``[B, H_kv, T, d]`` shared by every head, grown by doubling.

``tokens_seen`` counts every column processed (padding included, as ``DynamicLayer``
does), separately from what is stored: transformers derives the next RoPE position from
``get_seq_length()`` when no position ids are passed, so it must return tokens seen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

from restkv.residual import ResidualReadout


class CompressedLayer(CacheLayerMixin):
    """One layer's compressed K/V (see the module docstring for the segments)."""

    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        kept_keys: torch.Tensor,
        kept_values: torch.Tensor,
        kept_columns: torch.Tensor,
        tokens_seen: int,
        sliding_window: int | None = None,
        residual_log_counts: torch.Tensor | None = None,
        residual_columns: torch.Tensor | None = None,
        residual_readout: ResidualReadout | None = None,
        config=None,
    ) -> None:
        super().__init__()
        self.config = config  # the CompressionConfig that built the layer (None: not recorded)
        self.kept_keys = kept_keys
        self.kept_values = kept_values
        # int32 column indices in the padded batch (what attention masks index); -1 = unused slot.
        self.kept_columns = kept_columns.to(torch.int32)
        self.residual_log_counts = residual_log_counts
        # Sliding-window layers only: the padded-batch column of each entry's oldest member; an
        # entry is visible while all its members are (int32, -1 = no entry).
        self.residual_columns = None if residual_columns is None else residual_columns.to(torch.int32)
        self.residual_readout = residual_readout
        self.tail_keys: torch.Tensor | None = None
        self.tail_values: torch.Tensor | None = None
        self.tail_length = 0
        self.tokens_seen = tokens_seen
        self.prompt_tokens = tokens_seen
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.device = kept_keys.device
        self.is_initialized = True

    # ----------------------------------------------------------- contents
    @property
    def kept_counts(self) -> torch.Tensor:
        """``[B, H_kv]`` prompt tokens kept per row and KV head."""
        return (self.kept_columns >= 0).sum(dim=-1)

    @property
    def residual_width(self) -> int:
        """``R``: trailing slots of the kept tensors that may hold residual entries."""
        return 0 if self.residual_log_counts is None else self.residual_log_counts.shape[-1]

    @property
    def residual_counts(self) -> torch.Tensor:
        """``[B, H_kv]`` residual entries per row and KV head (0 without residuals)."""
        if self.residual_log_counts is None:
            return torch.zeros_like(self.kept_counts)
        return torch.isfinite(self.residual_log_counts).sum(dim=-1)

    @property
    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values appended after compression, ``[B, H_kv, T, d]``."""
        if self.tail_keys is None:
            empty = self.kept_keys[:, :, :0]
            return empty, empty
        return self.tail_keys[:, :, : self.tail_length], self.tail_values[:, :, : self.tail_length]

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append new tokens to the tail (amortised O(1) per token: the buffer doubles)."""
        new = key_states.shape[-2]
        needed = self.tail_length + new
        capacity = 0 if self.tail_keys is None else self.tail_keys.shape[-2]
        if needed > capacity:
            capacity = max(needed, 2 * capacity, 16)
            shape = (*key_states.shape[:2], capacity, key_states.shape[-1])
            grown_keys, grown_values = key_states.new_empty(shape), value_states.new_empty(shape)
            if self.tail_length:
                grown_keys[:, :, : self.tail_length] = self.tail_keys[:, :, : self.tail_length]
                grown_values[:, :, : self.tail_length] = self.tail_values[:, :, : self.tail_length]
            self.tail_keys, self.tail_values = grown_keys, grown_values
        self.tail_keys[:, :, self.tail_length : needed] = key_states
        self.tail_values[:, :, self.tail_length : needed] = value_states
        self.tail_length = needed
        self.tokens_seen += new

    def trim_tail_to_window(self) -> None:
        """Sliding-window layers: forget tail tokens that no future query can see."""
        if self.sliding_window is not None and self.tail_length > self.sliding_window - 1:
            drop = self.tail_length - (self.sliding_window - 1)
            keys, values = self.tail
            self.tail_keys, self.tail_values = keys[:, :, drop:].clone(), values[:, :, drop:].clone()
            self.tail_length -= drop

    def nbytes(self) -> int:
        """Bytes held by every tensor of the layer (tail counted at its used length)."""
        tensors = [self.kept_keys, self.kept_values, self.kept_columns]
        tensors += [t for t in (self.residual_log_counts, self.residual_columns) if t is not None]
        tensors += list(self.tail) if self.tail_length else []
        return sum(t.numel() * t.element_size() for t in tensors)

    # ----------------------------------------------------------- CacheLayerMixin
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise RuntimeError(
            "this cache layer was compressed by restkv and can only be read by restkv's patched attention; "
            "do not call restkv.unpatch() (or load a new model) while a compressed cache is in use"
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Mirror the layer type this one replaced, so masks built for the whole model agree."""
        if self.sliding_window is None:
            return self.tokens_seen + query_length, 0
        offset = max(self.tokens_seen - self.sliding_window + 1, 0)
        return min(self.tokens_seen, self.sliding_window - 1) + query_length, offset

    def get_seq_length(self) -> int:
        return self.tokens_seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Empty the layer: the next forward through it is a new prefill."""
        empty = self.kept_keys[:, :, :0]
        self.kept_keys = self.kept_values = empty
        self.kept_columns = self.kept_columns[:, :, :0]
        self.residual_log_counts = self.residual_columns = None
        self.tail_keys = self.tail_values = None
        self.tail_length = self.tokens_seen = self.prompt_tokens = 0

    def _map_batch(self, fn) -> None:
        for name in ("kept_keys", "kept_values", "kept_columns", "residual_log_counts", "residual_columns",
                     "tail_keys", "tail_values"):
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, fn(tensor))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest ``-tokens_to_remove`` tokens; only tokens of the tail can be removed."""
        if tokens_to_remove > 0 or -tokens_to_remove > self.tail_length:
            raise RuntimeError(
                f"a compressed layer can only drop tokens appended after compression ({self.tail_length}); "
                f"asked for crop({tokens_to_remove})"
            )
        self.tail_length += tokens_to_remove
        self.tokens_seen += tokens_to_remove


def native_layer(sliding_window: int | None) -> CacheLayerMixin:
    """A fresh transformers layer of the kind a compressed layer replaced."""
    if sliding_window is not None:
        return DynamicSlidingWindowLayer(sliding_window=sliding_window)
    return DynamicLayer()


# ---------------------------------------------------------------- reports
@dataclass(frozen=True)
class LayerReport:
    """What one cache layer holds. ``stored`` counts exact tokens per KV head (mean over rows and
    heads), ``residual`` summary entries; ``compressed`` is False when the layer kept everything."""

    layer: int
    kind: str
    tokens_seen: int
    stored_min: int
    stored_max: int
    stored_mean: float
    residual: float
    nbytes: int

    @property
    def compressed(self) -> bool:
        return self.kind == "compressed" and self.stored_max + self.residual < self.tokens_seen


def cache_report(cache: Cache) -> list[LayerReport]:
    """Per-layer tokens seen vs stored, so a run in which nothing was compressed is visible."""
    reports = []
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, CompressedLayer):
            stored = layer.kept_counts + layer.tail_length
            reports.append(
                LayerReport(
                    index, "compressed", layer.tokens_seen, int(stored.min()), int(stored.max()),
                    float(stored.float().mean()), float(layer.residual_counts.float().mean()), layer.nbytes(),
                )
            )
        else:
            seen = layer.get_seq_length() if layer.is_initialized else 0
            held = layer.keys.shape[-2] if layer.is_initialized and layer.keys is not None and layer.keys.dim() == 4 else 0
            nbytes = 0
            if held:
                nbytes = sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
            reports.append(LayerReport(index, "native", seen, held, held, float(held), 0.0, nbytes))
    return reports


def cache_nbytes(cache: Cache) -> int:
    """Bytes held by every layer of ``cache``."""
    return sum(report.nbytes for report in cache_report(cache))


def format_report(reports: list[LayerReport]) -> str:
    """A plain-text table of ``cache_report``."""
    lines = [f"{'layer':>5} {'kind':>10} {'seen':>7} {'stored(min/mean/max)':>22} {'residual':>8} {'MiB':>8}"]
    for r in reports:
        stored = f"{r.stored_min}/{r.stored_mean:.1f}/{r.stored_max}"
        lines.append(f"{r.layer:>5} {r.kind:>10} {r.tokens_seen:>7} {stored:>22} {r.residual:>8.1f} {r.nbytes / 2**20:>8.3f}")
    compressed = sum(r.compressed for r in reports)
    lines.append(f"{compressed} of {len(reports)} layers hold fewer entries than tokens seen")
    return "\n".join(lines)
