"""The compressed cache: a layer of typed segments read as one softmax (``layer``), what each segment
kind stores and how it reads itself (``segments``), the partial attentions they return and merge
(``partial``), and cache-wide reports (``report``)."""

from restkv.cache.layer import CompressedLayer, native_layer, new_token_columns
from restkv.cache.report import KeptPositions, LayerReport, cache_nbytes, cache_report, format_report, kept_positions

__all__ = ["CompressedLayer", "KeptPositions", "LayerReport", "cache_nbytes", "cache_report", "format_report",
           "kept_positions", "native_layer", "new_token_columns"]
