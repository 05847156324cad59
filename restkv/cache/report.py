"""What a cache holds, per layer: tokens seen against tokens stored, bytes allocated and used, each
segment's report (``cache_report``, printed by ``format_report``), and the positions each head
keeps (``kept_positions``), so a run that compressed nothing shows at a glance."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from restkv.cache.layer import CompressedLayer
from restkv.cache.segments.base import SegmentReport, tensor_bytes


# ---------------------------------------------------------------- reports
@dataclass(frozen=True)
class LayerReport:
    """What one cache layer holds: tokens seen, the exact tokens stored per KV head (min, mean and
    max over rows and heads, appended ones included), bytes, and one ``SegmentReport`` per
    segment (kind, tokens, token-slot equivalents, bytes); ``kind`` is ``compressed``, ``native``,
    or ``state`` (a hybrid model's linear-attention or Mamba layer: a fixed-size state, no tokens).
    ``nbytes`` is what the layer's buffers hold (a compressed layer's spare room for appended tokens
    included), ``used_nbytes`` what it stores."""

    layer: int
    kind: str
    tokens_seen: int
    stored_min: int
    stored_max: int
    stored_mean: float
    nbytes: int
    segments: tuple[SegmentReport, ...] = ()
    #: how the kept tokens are held (``exact``, ``kivi 4-bit``, ``keys 38/64 channels``...)
    storage: str = "exact"
    used_nbytes: int | None = None

    def __post_init__(self) -> None:
        if self.used_nbytes is None:
            object.__setattr__(self, "used_nbytes", self.nbytes)

    @property
    def summary_slots(self) -> float:
        """Token-slot equivalents per row and KV head of what stands for evicted tokens (summary
        entries, statistics, memories): the segments that hold no exact token."""
        return sum(segment.slots for segment in self.segments if segment.tokens is None)

    @property
    def compressed(self) -> bool:
        return self.kind == "compressed" and self.stored_max + self.summary_slots < self.tokens_seen


def _holds_keys(layer) -> bool:
    """Whether a transformers cache layer holds attention keys (a hybrid model's linear-attention and
    Mamba layers hold states instead)."""
    return isinstance(layer, CacheLayerMixin) and hasattr(layer, "keys")


def _state_nbytes(layer) -> int:
    """Bytes of a state layer's convolution and recurrent states."""
    states = [*getattr(layer, "conv_states", {}).values(), *getattr(layer, "recurrent_states", {}).values()]
    return tensor_bytes([state for state in states if isinstance(state, torch.Tensor)])


def cache_report(cache: Cache) -> list[LayerReport]:
    """Per-layer tokens seen vs stored, so a run in which nothing was compressed is visible.

    Example::

        with restkv.compression(model, method="snapkv", max_capacity_prompts=128):
            cache = restkv.prefill(model, input_ids)
        print(restkv.format_report(restkv.cache_report(cache)))
    """
    reports = []
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, CompressedLayer):
            stored = layer.held_counts
            segments = tuple(layer.reports())
            reports.append(LayerReport(index, "compressed", layer.tokens_seen, int(stored.min()), int(stored.max()),
                                       float(stored.float().mean()), layer.nbytes(), segments, layer.storage,
                                       layer.used_nbytes()))
        elif not _holds_keys(layer):
            reports.append(LayerReport(index, "state", 0, 0, 0, 0.0, _state_nbytes(layer)))
        else:
            seen = layer.get_seq_length() if layer.is_initialized else 0
            held = layer.keys.shape[-2] if layer.is_initialized and layer.keys is not None and layer.keys.dim() == 4 else 0
            nbytes = tensor_bytes([layer.keys, layer.values]) if held else 0
            reports.append(LayerReport(index, "native", seen, held, held, float(held), nbytes))
    return reports


def cache_nbytes(cache: Cache) -> int:
    """Bytes held by every layer of ``cache`` (allocated: what its memory holds)."""
    return sum(report.nbytes for report in cache_report(cache))


def format_report(reports: list[LayerReport]) -> str:
    """A plain-text table of ``cache_report``: per layer its stored tokens and one column per
    segment (kind, token-slot equivalents)."""
    lines = [f"{'layer':>5} {'kind':>10} {'seen':>7} {'stored(min/mean/max)':>22} {'MiB':>8}  segments (slots per head)"]
    # MiB: what each layer's buffers hold (spare room for appended tokens included)
    for r in reports:
        stored = f"{r.stored_min}/{r.stored_mean:.1f}/{r.stored_max}"
        parts = ", ".join(f"{segment.kind} {segment.slots:.1f}" for segment in r.segments) or "native"
        lines.append(f"{r.layer:>5} {r.kind:>10} {r.tokens_seen:>7} {stored:>22} {r.nbytes / 2**20:>8.3f}  {parts}")
    compressed = sum(r.compressed for r in reports)
    attention = sum(r.kind != "state" for r in reports)
    lines.append(f"{compressed} of {attention} attention layers hold fewer entries than tokens seen")
    return "\n".join(lines)


@dataclass(frozen=True)
class KeptPositions:
    """What one cache layer keeps, as row-local positions (0 = a row's first real token).

    exact: ``[B][H_kv]`` sorted positions of the exact tokens held (kept prompt tokens and tokens
    appended later). summaries: ``[B][H_kv]`` how many summary entries (ResKV's residual entries,
    MomentKV's entry) the head holds beside them; they stand for evicted tokens and have no
    single position.
    """

    exact: list[list[list[int]]]
    summaries: list[list[int]]


def kept_positions(cache: Cache) -> list[KeptPositions]:
    """Per layer, the positions each row and KV head keeps (``KeptPositions``): what parity
    tests compare with another library's kept sets. A native layer (nothing evicted) lists
    every column it holds: it does not know a row's left padding, so read it on unpadded rows.
    A hybrid model's state layer (linear attention, Mamba) keeps no tokens: empty lists.

    Example: ``restkv.kept_positions(cache)[0].exact[0][0]`` lists the prompt positions layer 0 keeps for
    row 0 and KV head 0."""
    result = []
    for layer in cache.layers:
        if isinstance(layer, CompressedLayer):
            columns = layer.kept_tokens(appended=True)[2]
            padding = layer.prompt_padding.to(columns.device)[:, None, None]
            positions = torch.where(columns >= 0, columns - padding, -1)
            exact = [[head[head >= 0].tolist() for head in row] for row in positions]
            summaries = layer.summary_counts.tolist()
        elif not _holds_keys(layer):  # a hybrid model's state layer: no tokens
            exact, summaries = [], []
        else:
            keys = layer.keys if layer.is_initialized else None
            held = keys.shape[-2] if keys is not None and keys.dim() == 4 else 0
            batch, heads = (keys.shape[0], keys.shape[1]) if held else (0, 0)
            exact = [[list(range(held)) for _ in range(heads)] for _ in range(batch)]
            summaries = [[0] * heads for _ in range(batch)]
        result.append(KeptPositions(exact, summaries))
    return result
