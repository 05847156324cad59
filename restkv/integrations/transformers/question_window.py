"""A prompt's question found from a delimiter token, and the token taken out before the model runs.

A method whose window is the question (Finch's ``--finch_delimiter ID``: ``Policy.question_delimiter``)
reads prompts that hold the token ``ID`` once, between the context and the question. At a prefill the
decoder's forward (``attention.model_forward``) takes it out of the input ids, the attention mask, the
position ids and the cache positions, so the model sees and caches the prompt without it, at the positions
it has without it; the tokens after it are the prefill's observation window (the run's config with
``window_size`` set to their count, for this forward only). A later forward on that cache is given in
the prompt's own columns, the delimiter's counted, as ``generate`` continues the prompt it was given (and
``restkv``'s continuation helpers from the prompt's length): it is moved back by that column, so the
answer's tokens continue where the delimiter-free prompt ends. Query-agnostic generation
(``generate_after_context``, ``answer_many``) compresses the context before the question is seen, so a
context that holds the delimiter is refused there.

A prompt without the token, with it twice, with nothing after it, or a batch whose rows' questions differ
in length is a one-line ``ValueError`` naming the flag, before the model runs.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from transformers import DynamicCache

from restkv.config import CompressionConfig, ConfigError
from restkv.integrations.transformers.compat import CACHE_ARGUMENT, with_cache
from restkv.integrations.transformers.handles import (cache_state, has_class_config, module_config_entry,
                                                      restore_module_config, set_module_config)


def question_forward(run: Callable, decoder, config: CompressionConfig, kwargs: dict):
    """A decoder forward (``run(kwargs)``) of a model whose config finds its window from a delimiter: a prefill
    without it and with the question as its window, a later forward on its cache moved back by its column."""
    cache = kwargs.get(CACHE_ARGUMENT, kwargs.get("past_key_values"))
    if cache is not None and cache.get_seq_length() > 0:
        return run(continue_prompt(cache, kwargs) if cache_state(cache).question_columns is not None else kwargs)
    if cache is None and kwargs.get("use_cache") is not False:
        kwargs = {**kwargs, **with_cache(DynamicCache(config=decoder.config))}
    kwargs, window = strip_prompt(config, kwargs)
    with question_as_window(decoder, config, window):
        return run(kwargs)


def _flag(config: CompressionConfig) -> str:
    return f"--finch_delimiter {config.policy.question_delimiter}"


def strip_prompt(config: CompressionConfig, kwargs: dict) -> tuple[dict, int]:
    """A prefill's keyword arguments without the delimiter's column, and the question's length after it."""
    ids = kwargs.get("input_ids")
    if ids is None:
        raise ValueError(f"{_flag(config)} finds the question in the input ids; this prefill gives inputs_embeds")
    found = ids == config.policy.question_delimiter
    counts = found.sum(dim=-1)
    if not bool((counts == 1).all()):
        row = int(torch.nonzero(counts != 1)[0, 0])
        raise ValueError(f"{_flag(config)}: the prompt must hold the delimiter once, between the context and the "
                         f"question; row {row} holds it {int(counts[row])} times")
    columns = found.int().argmax(dim=-1)
    windows = (ids.shape[-1] - 1 - columns).unique()
    if len(windows) > 1:
        raise ValueError(f"{_flag(config)}: the rows' questions differ in length ({windows.tolist()} tokens after the "
                         "delimiter); a batch has one window: give its rows apart")
    if int(windows[0]) == 0:
        raise ValueError(f"{_flag(config)}: nothing follows the delimiter; the question comes after it")
    stripped = dict(kwargs, input_ids=_drop(ids, columns))
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        stripped["attention_mask"] = _drop(mask, columns)
    positions = kwargs.get("position_ids")
    if positions is not None:
        positions = positions.expand(ids.shape[0], -1)
        after = torch.arange(ids.shape[-1] - 1, device=ids.device)[None] >= columns[:, None]
        stripped["position_ids"] = _drop(positions, columns) - after.to(positions.dtype)
    if kwargs.get("cache_position") is not None:
        stripped["cache_position"] = kwargs["cache_position"][:-1]
    cache = kwargs.get(CACHE_ARGUMENT, kwargs.get("past_key_values"))
    if cache is not None:
        cache_state(cache).question_columns = columns
    return stripped, int(windows[0])


def continue_prompt(cache, kwargs: dict) -> dict:
    """A later forward's keyword arguments, given in the prompt's own columns (the delimiter's counted, as
    ``generate`` gives them), moved back by that column: its position ids and cache positions one less, its mask
    without the delimiter's column (when it covers the prompt)."""
    moved = dict(kwargs)
    for name in ("position_ids", "cache_position"):
        if kwargs.get(name) is not None:
            moved[name] = kwargs[name] - 1
    mask, columns = kwargs.get("attention_mask"), cache_state(cache).question_columns
    tokens = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]
    if mask is not None and mask.dim() == 2 and mask.shape[-1] == cache.get_seq_length() + tokens.shape[1] + 1:
        moved["attention_mask"] = _drop(mask, columns.repeat_interleave(mask.shape[0] // len(columns)))
    return moved


def _drop(table: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """``table`` ``[B, L]`` without each row's column ``columns[row]``."""
    keep = torch.ones_like(table, dtype=torch.bool)
    keep[torch.arange(table.shape[0], device=table.device), columns.to(table.device)] = False
    return table[keep].view(table.shape[0], -1)


@contextlib.contextmanager
def question_as_window(decoder, config: CompressionConfig, window: int) -> Iterator[None]:
    """Every patched attention module of ``decoder`` runs ``config`` with the question's ``window`` for the block."""
    try:
        prompt_config = config.replace(window_size=window)
    except ConfigError as error:
        raise ConfigError(f"{_flag(config)}: the question has {window} tokens, the window: {error}") from None
    modules = [module for module in decoder.layers.modules() if has_class_config(type(module))]
    previous = [(module, module_config_entry(module)) for module in modules]
    for module in modules:
        set_module_config(module, prompt_config)
    try:
        yield
    finally:
        for module, entry in previous:
            restore_module_config(module, entry)
