"""Finch (Corallo & Papotti, TACL 2024, arXiv 2408.00167): keep what the question attends to.

The observation window is the question: the prompt's last ``--window_size`` tokens (in a
query-aware run, the question after the context). A past token's score is the attention the
window's queries give it, each query's row first multiplied by the number of earlier tokens it
sees (``--finch_normalize``, Finch's normalisation: a query late in a long prompt spreads its
attention thinner, so its weights count for more), averaged over the window and reduced over
each query group (``--gqa_score_agg``); no pooling. The window itself is always kept.

``--finch_delimiter ID`` finds the window as kvpress' ``FinchPress`` does: the prompt holds the
token ``ID`` once, between the context and the question; the question is the tokens after it
(``--window_size`` is then not read), and the token is taken out before the model runs, so the
model, the cache and the positions of every later token are those of the prompt without it
(``restkv.integrations.transformers.question_window``). It is a token id, not a string: restkv
finds it in the input ids, and it never reaches the embedding, so the model needs no new row
(kvpress adds ``<|finch_sep|>`` to the tokenizer and resizes the embeddings; its id,
``tokenizer.convert_tokens_to_ids("<|finch_sep|>")`` after ``add_special_tokens``, works here as
any id does).

Where this differs from kvpress' ``FinchPress``: without ``--finch_delimiter`` the window is
``--window_size`` tokens; with it, a batch's rows must share their question's length (kvpress
takes one row), and the tokens after the prompt continue at the delimiter-free positions (kvpress
continues them one further unless it re-rotates the keys). kvpress may compress chunk
by chunk of the context (``chunk_length``: ``--chunk_press --chunk_press_global
--chunk_press_length N`` here) and by default re-rotates the kept keys to consecutive positions
(``--rerotate_keys`` here, off by default as for every method). The normalising
count is the number of the row's real tokens before the query (on a sliding-window layer, at
most the window), which is kvpress' query position for an unpadded prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restkv.config.options import ConfigError, option, register
from restkv.pipeline.inputs import LayerInputs
from restkv.policies.base import GroupedScores


@register("method")
@dataclass(frozen=True)
class Finch(GroupedScores):
    name = "finch"
    reference = "Finch: Corallo & Papotti, TACL 2024, arXiv 2408.00167"

    finch_normalize: bool = option(
        True, "Finch: weight each window query's attention by the number of earlier tokens it sees"
    )
    finch_delimiter: int | None = option(
        None, "Finch: the id of a token the prompt holds once, between context and question: the tokens after it "
        "are the window (instead of --window_size), and it is taken out before the model runs (kvpress' "
        "<|finch_sep|>; it needs no embedding)", minimum=0)

    @property
    def question_delimiter(self) -> int | None:
        return self.finch_delimiter

    def check(self, config) -> None:
        super().check(config)
        if self.finch_delimiter is not None:
            flags = config.rescoring_flags(every_method=True)
            if flags:
                raise ConfigError(f"--finch_delimiter {self.finch_delimiter} finds the question of one whole prompt; "
                                  f"{' and '.join(flags)} would score what the layer holds with other queries")
        elif config.run.window_size == 0:
            raise ConfigError(f"--method {self.name} scores the context by the attention of the question, its last "
                              "--window_size tokens: --window_size 0 leaves none")
        if config.run.observation == "reconstruction":
            raise ConfigError(f"--method {self.name} weights each window query's attention row; --observation "
                              "reconstruction keeps no row per query (use --observation window)")

    def score(self, ctx: LayerInputs) -> torch.Tensor:
        weights = ctx.observation.attention()  # [B, H, w, N]
        if self.finch_normalize:
            earlier = ctx.valid.cumsum(dim=-1) - 1  # real tokens before each column
            if ctx.plan.sliding_window is not None:
                earlier = earlier.clamp(max=ctx.plan.sliding_window - 1)
            weights = weights * earlier[:, None, -weights.shape[2] :, None].float()
        return self.reduce(ctx, weights.mean(dim=2))
