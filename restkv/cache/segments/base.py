"""What every segment kind shares: the protocols a segment implements, its report, the bytes of its
tensors, and the bookkeeping of exact tokens (kept then appended tokens, spare room, copy-on-write
between forks).

A compressed layer (``restkv.cache.layer``) holds three roles of segment, each a declared protocol:

* ``TokenSegment``: tokens a query reads (held whole, as codes, with fewer key channels...), read as a
  partial attention whose log-sum-exp merges it exactly with the others;
* ``SummarySegment``: entries that stand for evicted tokens and join the token segments' softmax their own
  way (ResKV's residual entries, MomentKV's entry);
* ``CorrectionSegment``: what is applied to the attention output after the softmax (IndexMem's memory).

A new kind is one file holding a class that implements its role, made by a part (a ``TokenStorage`` part
makes token segments, a ``Summariser`` summaries or corrections: ``restkv.pipeline.compress``); the layer
refuses, when it is built, a segment that does not implement its role (``checked_segment``).

Exact tokens of a compressed layer: the segments that hold kept and appended tokens whole.

Every KV head of every row holds a *sequence*: the tokens it kept at its last compression
(ascending positions), then the tokens appended since (a question chunk, generated tokens),
then spare capacity, so a decode step writes its token in place and rarely reallocates
(``spare_slots``: an eighth of what the sequence holds, or the generation's length when the
caller knows it, ``reserve``; it grows by the same share when it runs out). Each token carries its padded-batch column
(``-1``: an unused slot, or an appended padding token), which is all a probe needs to say who
sees it (``restkv.cache.partial.Probe.visibility``). Two layouts:

* ``DenseTokens``: one ``[B, H_kv, W, d]`` buffer, every head's sequence at the same slots (heads
  that keep fewer tokens leave holes, marked by their columns). A step reads one contiguous
  block: ``[:, :, :used]``, one fused kernel call, no mask when there is no hole.
* ``RaggedTokens``: each (row, KV head)'s sequence back to back in one ``[N, d]`` buffer, so
  head-adaptive budgets (AdaKV, HeadKV, LaProx, KVzip) hold what they allocate. A step reads
  each sequence where it lies (one kernel call per row and KV head; nothing is re-padded).

``exact_tokens`` picks the ragged layout when the dense one would waste more than
``RAGGED_WASTE`` of its kept slots. Both report their kind, tokens, token-slot equivalents and
bytes (``SegmentReport``): the bytes their buffers hold (spare capacity included), and the bytes
of the slots in use (kept and appended tokens, their int32 columns).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch

#: the share of padded kept slots above which a layer is stored ragged
RAGGED_WASTE = 0.02


#: spare capacity for appended tokens, as a share of what a sequence holds (and its least)
SPARE_SHARE, MIN_SPARE = 0.125, 4


def spare_slots(held: int) -> int:
    """The appended-token room a sequence holding ``held`` tokens gets when it is built or grows:
    ``SPARE_SHARE`` of them, so memory follows the budget (at least ``MIN_SPARE``); a grown
    buffer is then ``1 + SPARE_SHARE`` times its tokens, and growing stays amortised."""
    return max(MIN_SPARE, math.ceil(SPARE_SHARE * held))


@dataclass(frozen=True)
class SegmentReport:
    """What one segment holds.

    kind: ``exact dense``, ``exact ragged``, ``kivi 4-bit``, ``keys 38/64 channels``, ``reskv entries``...
    tokens: ``[B, H_kv]`` exact tokens it holds (None for summaries: they stand for evicted tokens).
    slots: token-slot equivalents per row and KV head (mean), a slot being one key and one value
        of the model dtype: what the segment takes from the budget.
    nbytes: bytes its tensors hold (allocated, spare capacity included).
    used_nbytes: bytes of what it stores (its tensors at their used length); ``nbytes`` when it has
        no spare capacity.
    """

    kind: str
    tokens: torch.Tensor | None
    slots: float
    nbytes: int
    used_nbytes: int | None = None

    def __post_init__(self) -> None:
        if self.used_nbytes is None:
            object.__setattr__(self, "used_nbytes", self.nbytes)


@runtime_checkable
class Segment(Protocol):
    """What every segment does: say what it holds, and follow the cache it lives in."""

    def report(self) -> SegmentReport:
        """Its kind, tokens, token-slot equivalents and bytes (the cache's memory report)."""

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor it holds."""

    def fork(self) -> "Segment":
        """A copy for a snapshot of the cache (``answer_many``): itself when it is never written in place."""

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Segment":
        """The segment with ``fn`` applied to the batch dimension of its tensors (beam reordering, row selection)."""


@runtime_checkable
class TokenSegment(Segment, Protocol):
    """Tokens a query reads, held whole or stored another way (``CompressedLayer.kept``)."""

    #: ``exact dense``, ``kivi 4-bit``...: what the memory report calls it; ``storage``: how its tokens are held
    kind: str
    storage: str

    def attend(self, probe: Any) -> Any:
        """The probe's (``restkv.cache.partial.Probe``) attention over its tokens, as a ``Partial`` (output and
        log-sum-exp, the peak or count when a summary asks)."""

    def padded(self, appended: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, values, columns)`` ``[B, H_kv, S, d]`` of its tokens as a query would read them (dequantised,
        whole keys): what inspection and recompression take."""

    def kept_counts(self) -> torch.Tensor:
        """``[B, H_kv]`` tokens it held at the last compression."""

    def held_counts(self) -> torch.Tensor:
        """``[B, H_kv]`` tokens it holds (kept and appended since)."""


class SlotWriter(Protocol):
    """A token segment a decode step can read together with the others in ONE kernel call: it writes its
    slots, as attention reads them (dequantised, whole keys), into a shared buffer (``CompressedLayer.read``).
    Not runtime-checkable: the layer looks ``write_slots`` up on the segment's class, where an ``isinstance``
    check would evaluate ``slot_count`` and ``holes`` every step."""

    #: slots it writes (tokens and holes), and whether any is a hole
    slot_count: int
    holes: bool

    def write_slots(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Write its slots into ``keys``/``values`` ``[B, H_kv, slot_count, d]`` (views of the shared buffer);
        returns their columns ``[B, H_kv, slot_count]`` (-1: a hole)."""


@runtime_checkable
class SummarySegment(Segment, Protocol):
    """Entries standing for evicted tokens that join the token segments' softmax (``CompressedLayer.summaries``)."""

    kind: str
    #: whether ``join`` reads the exact partial's peak logit, or its count of visible tokens
    needs_peak: bool
    needs_count: bool

    def join(self, current: Any, exact: Any, probe: Any) -> Any:
        """``current`` (the partial so far) with this segment's entries joined; ``exact``: the token segments'."""

    def counts(self) -> torch.Tensor:
        """``[B, H_kv]`` entries it holds."""

    def budget_slots(self) -> torch.Tensor:
        """``[B, H_kv]`` token slots of the budget they take."""

    def as_slots(self) -> tuple:
        """``(keys, values, log_counts, oldest or None, value maps or None)``: the entries as slots of
        ``compress_kv``'s padded tensors."""


@runtime_checkable
class CorrectionSegment(Segment, Protocol):
    """What is applied to the attention output after the softmax (``CompressedLayer.corrections``)."""

    def correct(self, query: torch.Tensor, output: torch.Tensor, lse: torch.Tensor,
                pre_rope: torch.Tensor | None) -> torch.Tensor:
        """The corrected output, from the queries, the output, the token segments' log-sum-exp per query head
        and the queries before RoPE (None when the layer has no rotation to undo)."""


def checked_segment(segment: Any, role: type, made_by: str) -> Any:
    """``segment``, or a ``TypeError`` naming what of ``role`` (a protocol above) it does not implement."""
    if not isinstance(segment, role):
        members = {name for cls in role.__mro__ if cls.__module__ == __name__
                   for name in (*vars(cls), *vars(cls).get("__annotations__", {})) if not name.startswith("_")}
        missing = [name for name in sorted(members) if not hasattr(segment, name)]
        raise TypeError(f"{made_by} {type(segment).__name__} is not a {role.__name__}: it lacks {', '.join(missing)}")
    return segment


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def write_columns(target: torch.Tensor, first: int, count: int, columns: torch.Tensor | None) -> bool:
    """Write the columns of ``count`` appended tokens into ``target`` (``[B, H_kv, q]``, a view of a
    segment's columns): ``columns`` ``[B, q]`` (-1 = padding), or ``first, first + 1, ...`` when
    None. Returns whether a padding token came with them."""
    if columns is None:
        if count == 1:
            target.fill_(first)
        else:
            target.copy_(torch.arange(first, first + count, dtype=torch.int32, device=target.device))
        return False
    target.copy_(columns.to(torch.int32)[:, None, :])
    return bool((columns < 0).any())


class ExactTokens:
    """What both layouts share: the kept/appended bookkeeping and copy-on-write between forks."""

    kind: str
    storage = "exact"
    #: tokens appended since the last compression (the same for every sequence)
    appended: int
    _shared: bool

    def append_tokens(self, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor) -> None:
        """Append tokens another segment held, ``[B, H_kv, q, d]`` with their columns ``[B, H_kv, q]``
        (the same for every head: appended tokens are)."""
        self.append(keys, values, 0, columns[:, 0])

    def fork(self) -> "ExactTokens":
        """A copy that shares the buffers until either side writes (``answer_many``'s snapshots)."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        self._shared = twin._shared = True
        return twin

    @property
    def value_dim(self) -> int:
        return self.values.shape[-1]

    def _clone_buffers(self) -> None:
        """Copy the buffers a fork shares (``keys``, ``values``, ``columns``: both layouts hold them)."""
        self.keys, self.values, self.columns = self.keys.clone(), self.values.clone(), self.columns.clone()

    def _own(self) -> None:
        """Copy the buffers before the first write after a fork."""
        if self._shared:
            self._clone_buffers()
            self._shared = False

    @property
    def rows(self) -> int:
        """The batch size ``B``."""
        return self.columns.shape[0] if self.columns.dim() == 3 else self.shape[0]

    @property
    def kv_heads(self) -> int:
        """The KV heads ``H_kv``."""
        return self.columns.shape[1] if self.columns.dim() == 3 else self.shape[1]

    def report(self) -> SegmentReport:
        tokens = self.held_counts()
        return SegmentReport(self.kind, tokens, float(tokens.float().mean()) if tokens.numel() else 0.0,
                             self.nbytes(), self.used_nbytes())
