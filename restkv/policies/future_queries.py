"""The prompt's queries as a model of the queries to come (Expected Attention, CAPKV).

The queries that will read the cache (the answer's) do not exist when it is compressed; these
scorers model them by the prompt's own, before RoPE and after the row's ``--n_sink`` sinks,
turned by ``R``, the mean RoPE rotation of the ``--future_positions`` positions after the
prompt. ``R`` is read from the rotation the prompt's own positions were given
(``restkv.scoring.rope.following_rotation``), so any RoPE scaling transformers applies is followed, and a
layer without RoPE tables (``compress_kv`` without ``rotary``) is refused. The statistics need
every prompt query of a layer at once: a reconstruction observation, a model-wide allocation and
chunked prefill (which see a window of queries or none) are refused in one line. During generation
(``--decode_budget``, ``--decode_compression_ratio``) the queries of the tokens generated since the
last compression model those to come (kvpress' ``DecodingPress`` reads the hidden states of the same
tokens), turned by the mean rotation of the positions after the newest; a layer keeps them, at most
``max(--window_size, --decode_interval)``, with their RoPE tables. The sinks score above every other token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import ConfigError, option
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import GroupedScores, KeepsSinks
from restkv.policies.row_local import score_rows
from restkv.scoring.rope import following_rotation, rotation_matrix, unrotate

#: the most positions ``--future_positions`` may average (128k, a long-context model's whole window): the
#: mean rotation is taken over a float64 table of that many positions per row and layer
MAX_FUTURE_POSITIONS = 131072


@dataclass(frozen=True)
class FutureQueries(KeepsSinks, GroupedScores):
    """A scorer that models the queries to come by the prompt's own (after the sinks), turned by the
    mean RoPE rotation of the positions after the prompt; it reads every prompt query at once."""

    needs_rotary = True

    future_positions: int = option(
        512, "Expected Attention, CAPKV: positions after the prompt whose mean RoPE rotation turns the prompt's "
        f"queries (at most {MAX_FUTURE_POSITIONS})", minimum=1, maximum=MAX_FUTURE_POSITIONS)

    @property
    def reads_every_query(self) -> bool:
        return True

    def check(self, config) -> None:
        super().check(config)
        self.check_sinks(config)
        flags = []
        if config.compresses_after_prefill:
            flags += config.deferring_flags()
        if config.run.prefill_chunk_size is not None:
            flags.append(f"--prefill_chunk_size {config.run.prefill_chunk_size}")
        if flags:
            raise ConfigError(f"--method {self.name} models future queries by every prompt query of a layer at once; "
                              f"{' and '.join(flags)} leave{'s' if len(flags) == 1 else ''} it a window of them or "
                              "none")

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        generating = ctx.query_rotary is not None  # held tokens scored with the newest tokens' queries
        if not generating and ctx.query.shape[2] != ctx.key.shape[2]:
            raise ValueError(f"--method {self.name} reads every prompt query: give as many queries as keys")
        cos, sin = ctx.query_rotary if generating else ctx.rotary

        def row_scores(row: int, columns: slice) -> torch.Tensor:
            count = columns.stop - columns.start
            sinks = self.sinks_among(ctx, row, count)
            asked = slice(None) if generating else columns  # the queries' own tables
            row_cos, row_sin = cos[row, asked], sin[row, asked]
            queries = unrotate(ctx.query[row : row + 1, :, asked], row_cos[None], row_sin[None])[0].float()
            rotation = rotation_matrix(*following_rotation(row_cos, row_sin, self.future_positions)).float()
            scores = self.future_scores(ctx, queries if generating else queries[:, sinks:],
                                        ctx.key[row, :, columns][:, sinks:].float(),
                                        ctx.value[row, :, columns][:, sinks:].float(), rotation)
            full = torch.empty(scores.shape[0], count, dtype=torch.float32, device=scores.device)
            full[:, sinks:] = scores
            full[:, :sinks] = scores.max() + 1 if scores.numel() else 1.0
            return full

        return score_rows(ctx, row_scores)

    def future_scores(self, ctx: LayerInputs, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      rotation: torch.Tensor) -> torch.Tensor:
        """``[H_kv, n]`` the scores of one row's tokens after the sinks: ``queries`` ``[H, n, d]``
        before RoPE, ``keys``/``values`` ``[H_kv, n, d]`` (keys after RoPE), ``rotation`` ``[d, d]``."""
        raise NotImplementedError
