"""What every segment kind shares: its report, the bytes of its tensors, and the bookkeeping of
exact tokens (kept then appended tokens, spare room, copy-on-write between forks).

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
