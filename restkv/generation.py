"""Query-aware and query-agnostic generation (``prefill``, ``generate_after_context``, ``answer_many``,
``answer_nll``): the public path of ``restkv.integrations.transformers.generation`` (the first three are also
``restkv.prefill``...)."""

from restkv.integrations.transformers.generation import (answer_many, answer_nll, generate_after_context,
                                                         position_ids_from_mask, prefill)

__all__ = ["answer_many", "answer_nll", "generate_after_context", "position_ids_from_mask", "prefill"]
