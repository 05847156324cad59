"""SimLayerKV (Zhang et al., 2025, arXiv 2410.13846): compress only the lazy layers.

A layer is lazy when its last prompt queries (``--simlayer_last_queries``) put more than
``--simlayer_threshold`` of their attention, averaged over heads and queries, on the first
``--n_sink`` tokens and the ``budget - n_sink + last_queries`` tokens before those queries (their
own keys are not counted): it barely reads the rest, so it keeps what StreamingLLM keeps (the
sinks and the newest ``budget - n_sink``). A layer that is not lazy keeps every token, whatever
the budget: memory follows how many layers are lazy (per row of a batch), not the budget alone.

As kvpress' ``SimLayerKVPress`` (its ``n_recent`` is ``budget - n_sink + n_last`` here, its
``lazy_threshold`` 1.0 turns the method off); the paper's decode-time variant is not built: with
``--prefill_chunk_size`` or ``--decode_budget`` each compression tells the layer's laziness again
from the newest queries.
"""

from __future__ import annotations

from dataclasses import dataclass

from restkv.config.options import register
from restkv.policies.streamingllm import StreamingLLM


@register("method")
@dataclass(frozen=True)
class SimLayerKV(StreamingLLM):
    name = "simlayerkv"
    reference = "SimLayerKV: Zhang et al., 2025, arXiv 2410.13846"
    allocation = "simlayer"
