"""``--quant_method kivi`` (KIVI, arXiv 2402.02750): the compressed cache stored as asymmetric codes,
keys per channel and values per token (``restkv.cache.segments.quantized``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from restkv.cache.segments.quantized import CODES_PER_BYTE, QuantizedTensor, QuantizedTokens, quantize
from restkv.config.options import ConfigError, Options, option, register


def sink_slots(columns: torch.Tensor, padding: torch.Tensor | None, count: int) -> torch.Tensor:
    """bool ``[B, H_kv, S]``: the slots whose token is one of each row's first ``count`` real
    tokens (``columns``: padded-batch columns, -1 for slots without an exact token;
    ``padding`` ``[B]``: each row's left padding)."""
    position = columns if padding is None else columns - padding.to(columns.device)[:, None, None]
    return (columns >= 0) & (position < count)


# ---------------------------------------------------------------- the parts
@register("quantization")
@dataclass(frozen=True)
class KIVI(Options):
    """KIVI: keys per channel, values per token, asymmetric ``--nbits`` codes in groups."""

    name = "kivi"
    reference = "KIVI: Liu et al., ICML 2024, arXiv 2402.02750"

    nbits: int = option(8, "--quant_method: bits per quantised key/value element (2, 4 or 8)")
    quant_group_size: int = option(
        64, "--quant_method: elements per scale/zero-point group (tokens of a key channel, channels of a value "
        "token; at most the head dimension for values)", minimum=1,
    )
    quant_residual_length: int = option(
        128, "--quant_method: KIVI's residual R: each head's newest R kept tokens stay exact, and while decoding "
        "the newest R at least (once 2R are exact the oldest R are quantised as one block; a multiple of "
        "--quant_group_size)", minimum=1,
    )

    #: the first prompt tokens kept exactly (KVQuant's attention sinks; none for KIVI)
    exact_sinks = 0

    def validate(self) -> None:
        if self.nbits not in CODES_PER_BYTE:
            raise ConfigError(f"--nbits must be one of 2, 4, 8; got {self.nbits}")
        if self.quant_residual_length % self.quant_group_size:
            raise ConfigError(
                f"--quant_residual_length {self.quant_residual_length} must be a multiple of --quant_group_size "
                f"{self.quant_group_size} (a quantised block holds whole key groups)"
            )

    def check(self, config) -> None:
        if not config.policy.evicts:
            raise ConfigError(f"--quant_method quantises the compressed cache; --method {config.policy.name} "
                              "keeps the native cache")
        if config.rescores:
            raise ConfigError("--quant_method stores evicted layers quantised once; --prefill_chunk_size and "
                              "--decode_budget evict again from exact entries (not supported together)")

    def exact_recent_tokens(self, config) -> int:
        """Each head's newest kept tokens that stay exact beside the codes: KIVI's residual
        (``--quant_residual_length``; KIVI keeps that many values, and the last L mod R keys)."""
        return self.quant_residual_length

    def storing(self, ctx, keys: torch.Tensor, columns: torch.Tensor):
        """The older tokens as codes (``restkv.pipeline.compress.TokenStorage``): the innermost way, made from the
        tokens themselves."""
        return partial(self._codes, ctx.row_padding)

    def _codes(self, padding, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor,
               inner) -> QuantizedTokens:
        return QuantizedTokens(keys, values, columns, self, padding)

    def seal_blocks(self):
        """``(seal, every)``: while decoding, once the tail holds twice ``--quant_residual_length`` exact tokens,
        its oldest ``--quant_residual_length`` become one block of codes."""
        return partial(QuantizedTokens, quantizer=self), self.quant_residual_length

    def outliers(self, x: torch.Tensor, member: torch.Tensor, per_channel: bool) -> torch.Tensor | None:
        """bool ``[..., S, d]``: the ``member`` elements kept exactly in the side store (None: no side store)."""
        return None

    def exact_sink_slots(self, columns: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor | None:
        """bool ``[B, H_kv, S]``: the slots of a layer's entries (``columns`` ``[B, H_kv, S]``,
        padded-batch, -1 where no exact token; ``padding`` ``[B]``) that a storage keeps
        exactly, passed as ``exact`` to ``quantize_keys``/``quantize_values``; None when none are."""
        return sink_slots(columns, padding, self.exact_sinks) if self.exact_sinks else None

    def quantize_keys(self, keys: torch.Tensor, valid: torch.Tensor | None = None,
                      exact: torch.Tensor | None = None) -> QuantizedTensor:
        """``[..., S, d]`` keys, per channel (groups of ``--quant_group_size`` tokens); ``exact``
        ``[..., S]``: slots kept whole in the side store (``exact_sink_slots``)."""
        return self._quantize(keys, self.quant_group_size, True, valid, exact)

    def quantize_values(self, values: torch.Tensor, valid: torch.Tensor | None = None,
                        exact: torch.Tensor | None = None) -> QuantizedTensor:
        """``[..., S, d]`` values, per token (groups of ``--quant_group_size`` channels, at most ``d``)."""
        return self._quantize(values, min(self.quant_group_size, values.shape[-1]), False, valid, exact)

    def _quantize(self, x: torch.Tensor, group: int, per_channel: bool, valid: torch.Tensor | None,
                  exact: torch.Tensor | None) -> QuantizedTensor:
        member = torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device) if valid is None else valid
        sinks = None if exact is None else (member & exact)[..., None].expand_as(x)
        dense = member[..., None].expand_as(x) if sinks is None else member[..., None] & ~sinks
        outliers = self.outliers(x, dense, per_channel)  # the sinks do not move a vector's percentiles
        if sinks is not None:
            outliers = sinks if outliers is None else outliers | sinks
        return quantize(x, self.nbits, group, per_channel, valid, outliers)
