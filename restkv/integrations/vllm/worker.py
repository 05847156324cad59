"""The worker side: compress each request's layers as its prefill ends, and keep slots apart from positions.

Three seams of vLLM's model runner, patched once per process (``install``), and its ``initialize_kv_cache``,
where the layers are hooked and one made-up prompt compressed, so that what a method needs and a layer cannot
give stops the engine's start:

* ``_prepare_inputs``: after vLLM computes the step's positions, seq lens and slot mapping from each request's
  true length, a compressed request's slots and seq len are moved down by the tokens it gave back, while its
  positions (RoPE) stay; the step's plan (``RowWork``: which rows end their prompt, which keep a chunk for
  later) is made here.
* every attention layer's ``impl.forward``: after vLLM's own attention, the rows of the plan are compressed
  (``restkv.integrations.vllm.selection.select_kept``) and their kept keys and values written into the request's
  first slots with the backend's own cache-write kernel (``do_kv_cache_update``), whatever its layout.
* ``_update_states``: before the next step appends new blocks, the rows compressed last step drop the blocks
  the scheduler took back (``restkv.integrations.vllm.scheduler``), so both sides list the same blocks.

The scheduler and this side agree without messages: both derive a request's given-back slots from its prompt
length (``VllmCompression.evicted_tokens``) at the step its prompt ends.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from restkv.config import ConfigError
from restkv.integrations.vllm.record import record_folder, write_kept
from restkv.integrations.vllm.selection import select_kept
from restkv.integrations.vllm.settings import ENVIRONMENT_VARIABLE, VllmCompression, VllmSettingsError


@dataclass
class RowWork:
    """One prefilling request's part of a step: its tokens ``start .. start + count`` of the batch, the positions
    ``first .. first + count``; ``kept`` > 0 when its prompt ends here (the tokens each layer keeps, written to
    ``slots``), else 0 (its keys, values and last queries are kept for the step that ends it)."""

    req_id: str
    start: int
    count: int
    kept: int = 0
    slots: torch.Tensor | None = None


@dataclass
class HeldChunks:
    """A prefilling request's earlier chunks of one layer, until its last chunk is scored."""

    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)
    queries: torch.Tensor | None = None


class WorkerLedger:
    """What this worker knows of each request's compression (see the module docstring)."""

    def __init__(self, compression: VllmCompression) -> None:
        self.compression = compression
        #: slots each compressed request gave back (its positions minus its slots)
        self.evicted: dict[str, int] = {}
        #: blocks each request compressed in the last step keeps
        self.truncations: dict[str, int] = {}
        #: earlier chunks of requests whose prompt spans steps, by request and layer
        self.held: dict[str, dict[int, HeldChunks]] = {}
        self.step: list[RowWork] = []
        self.num_layers = 0
        #: each attention layer's output projection ``[D, H_q * d]`` (this worker's heads), for ReST-KV's scores
        self.output_projections: dict[str, torch.Tensor] = {}
        #: where kept positions are recorded (``restkv.integrations.vllm.record``), and those of this step
        self.records = record_folder()
        self.recorded: dict[str, dict[int, torch.Tensor]] = {}

    def forget(self, req_id: str) -> None:
        self.evicted.pop(req_id, None)
        self.truncations.pop(req_id, None)
        self.held.pop(req_id, None)

    # ------------------------------------------------------------------ the runner's seams
    def before_update(self, runner, scheduler_output) -> None:
        """Drop the blocks given back after last step's compression; forget finished, preempted and resumed
        requests (a resumed request is prefilled and compressed again)."""
        cached = scheduler_output.scheduled_cached_reqs
        fresh = (set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
                 | {new.req_id for new in scheduler_output.scheduled_new_reqs} | set(cached.resumed_req_ids))
        for req_id, blocks in self.truncations.items():
            if req_id in fresh:
                continue
            state = runner.requests.get(req_id)
            if state is not None:
                for ids in state.block_ids:
                    del ids[blocks:]
            row = runner.input_batch.req_id_to_index.get(req_id)
            if row is not None:
                for table in runner.input_batch.block_table.block_tables:
                    held = int(table.num_blocks_per_row[row])
                    table.block_table.np[row, blocks:held] = 0
                    table.num_blocks_per_row[row] = min(blocks, held)
        self.truncations.clear()
        for req_id in fresh:
            self.forget(req_id)

    def after_prepare(self, runner, num_scheduled_tokens: np.ndarray) -> None:
        """Move compressed requests' slots and seq lens down by what they gave back, and plan the step."""
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        req_ids = batch.req_ids[:num_reqs]
        shifts = np.array([self.evicted.get(req_id, 0) for req_id in req_ids], dtype=np.int64)
        if shifts.any():
            total = int(num_scheduled_tokens.sum())
            per_token = torch.from_numpy(np.repeat(shifts, num_scheduled_tokens[:num_reqs]))
            slot_positions = runner.positions[:total] - per_token.to(runner.positions.device)
            batch.block_table.compute_slot_mapping(num_reqs, runner.query_start_loc.gpu[: num_reqs + 1], slot_positions)
            shift = torch.from_numpy(shifts.astype(np.int32))
            runner.seq_lens[:num_reqs] -= shift.to(runner.seq_lens.device)
            runner.optimistic_seq_lens_cpu[:num_reqs] -= shift.to(runner.optimistic_seq_lens_cpu.dtype)
        self.held = {req_id: layers for req_id, layers in self.held.items() if layers}
        self.step = []
        starts = runner.query_start_loc.np
        table = batch.block_table.block_tables[0]
        for row, req_id in enumerate(req_ids):
            first, count, prompt = (int(batch.num_computed_tokens_cpu[row]), int(num_scheduled_tokens[row]),
                                    int(batch.num_prompt_tokens[row]))
            evicted = self.compression.evicted_tokens(prompt)
            if first >= prompt or req_id in self.evicted or evicted == 0:
                continue
            work = RowWork(req_id, int(starts[row]), count)
            if first + count >= prompt:  # the prompt ends in this step: every token so far is scored at once
                work.kept = first + count - evicted
                blocks = table.block_table.np[row, : -(-work.kept // table.block_size)]
                slots = np.arange(work.kept)
                work.slots = torch.from_numpy(blocks[slots // table.block_size].astype(np.int64) * table.block_size
                                              + slots % table.block_size).to(runner.positions.device)
                self.evicted[req_id] = evicted
                self.truncations[req_id] = len(blocks)
            self.step.append(work)

    def select(self, layer, layer_idx: int, queries, keys, values, kept: int):
        """``select_kept`` with what ``layer`` is (its scale, soft-cap, output projection)."""
        impl = layer.impl
        return select_kept(self.compression.config, queries, keys, values, kept, layer_idx, self.num_layers, impl.scale,
                           getattr(impl, "logits_soft_cap", None), self.output_projections.get(layer.layer_name))

    def after_attention(self, layer, layer_idx: int, query, key, value, kv_cache) -> None:
        """Compress this layer for the rows of the step whose prompt ends here; hold the chunks of the others."""
        impl = layer.impl
        window = self.compression.trailing_queries
        heads, kv_heads, head_dim = impl.num_heads, impl.num_kv_heads, impl.head_size
        for work in self.step:
            tokens = slice(work.start, work.start + work.count)
            chunk_query = query[tokens].reshape(work.count, heads, head_dim)
            chunk_key = key[tokens].reshape(work.count, kv_heads, head_dim)
            chunk_value = value[tokens].reshape(work.count, kv_heads, head_dim)
            held = self.held.setdefault(work.req_id, {}).setdefault(layer_idx, HeldChunks())
            queries = chunk_query if held.queries is None else torch.cat([held.queries, chunk_query])
            if not work.kept:
                held.keys.append(chunk_key.clone())
                held.values.append(chunk_value.clone())
                held.queries = queries[-window:].clone()
                continue
            keys, values = torch.cat([*held.keys, chunk_key]), torch.cat([*held.values, chunk_value])
            del self.held[work.req_id][layer_idx]
            kept = self.select(layer, layer_idx, queries[-window:], keys, values, work.kept)
            impl.do_kv_cache_update(layer, kept.keys.contiguous(), kept.values.contiguous(), kv_cache, work.slots)
            if self.records is not None:
                self.recorded.setdefault(work.req_id, {})[layer_idx] = kept.positions

    def write_records(self, runner) -> None:
        """The kept positions of the requests compressed in the step that just ran."""
        for req_id, positions in self.recorded.items():
            write_kept(self.records, req_id, runner.requests[req_id].prompt_token_ids, positions)
        self.recorded = {}


def _hook_attention(runner, ledger: WorkerLedger) -> None:
    """Wrap every attention layer's ``impl.forward`` once (the layers are known once the model is loaded)."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.models.utils import extract_layer_index

    layers = [layer for layer in runner.compilation_config.static_forward_context.values()
              if isinstance(layer, Attention)]
    groups = runner.kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise VllmSettingsError(f"{ENVIRONMENT_VARIABLE}: the model's KV cache has {len(groups)} groups of layers; "
                                "restkv in vLLM compresses models whose layers share one block table")
    ledger.num_layers = runner.model_config.get_total_num_hidden_layers()  # layer indices are global under PP
    for layer in layers:
        impl = layer.impl
        if not hasattr(impl, "do_kv_cache_update"):
            raise VllmSettingsError(f"{ENVIRONMENT_VARIABLE}: the attention backend {type(impl).__name__} writes its "
                                    "cache inside its kernel; restkv needs one with a separate cache write")
        impl.forward = _compressing_forward(impl.forward, extract_layer_index(layer.layer_name), ledger)
        projection = _output_projection(runner.model, layer.layer_name, runner.model_config.dtype, runner.device)
        if projection is not None:
            ledger.output_projections[layer.layer_name] = projection
    if layers:
        _try_layer(ledger, layers[0])


def _try_layer(ledger: WorkerLedger, layer) -> None:
    """Compress a made-up prompt as ``layer`` would compress a real one, so that what the method needs and the
    layer cannot give (an output projection, say) stops the engine's start instead of its first request."""
    impl, window = layer.impl, ledger.compression.trailing_queries
    kept = window + 4
    keys = torch.randn(2 * kept, impl.num_kv_heads, impl.head_size)
    try:
        ledger.select(layer, 0, torch.randn(window, impl.num_heads, impl.head_size), keys, keys, kept)
    except (ConfigError, ValueError) as error:
        raise VllmSettingsError(f"{ENVIRONMENT_VARIABLE}: {error}") from None


def _output_projection(model, layer_name: str, dtype: torch.dtype, device) -> torch.Tensor | None:
    """The ``o_proj`` weight ``[D, H_q * d]`` beside attention layer ``layer_name`` (``...self_attn.attn``), where
    the model has one (vLLM's decoders name it so); None elsewhere (a scorer in output space then says it needs it).
    Where vLLM packed it for its CPU GEMM and dropped ``.weight``, it is read back through the layer's own matmul
    of the identity (this worker's shard under tensor parallelism)."""
    try:
        projection = model.get_submodule(layer_name.rsplit(".", 1)[0]).o_proj
    except AttributeError:
        return None
    weight = getattr(projection, "weight", None)
    if weight is not None and weight.dim() == 2 and weight.numel():
        return weight
    identity = torch.eye(projection.input_size_per_partition, dtype=dtype, device=device)
    with torch.no_grad():
        return projection.quant_method.apply(projection, identity).T.contiguous()


def _compressing_forward(native, layer_idx: int, ledger: WorkerLedger):
    def forward(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        output = native(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
        if ledger.step and attn_metadata is not None:
            ledger.after_attention(layer, layer_idx, query, key, value, kv_cache)
        return output

    return forward


#: each model runner's ledger, beside it
_LEDGERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_installed: list[bool] = []


def install(compression: VllmCompression) -> None:
    """Patch vLLM's model runner in this process (idempotent)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if _installed:
        return
    update_states, prepare_inputs, execute_model = (GPUModelRunner._update_states, GPUModelRunner._prepare_inputs,
                                                    GPUModelRunner.execute_model)
    initialize_kv_cache = GPUModelRunner.initialize_kv_cache

    def ledger_of(runner) -> WorkerLedger:
        ledger = _LEDGERS.get(runner)
        if ledger is None:
            ledger = _LEDGERS[runner] = WorkerLedger(compression)
            _hook_attention(runner, ledger)
        return ledger

    def initialize_kv_cache_(self, *args, **kwargs):
        result = initialize_kv_cache(self, *args, **kwargs)
        ledger_of(self)  # the layers hooked, and tried, as the engine starts
        return result

    def _update_states_(self, scheduler_output):
        ledger_of(self).before_update(self, scheduler_output)
        return update_states(self, scheduler_output)

    def _prepare_inputs_(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
        result = prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
        ledger_of(self).after_prepare(self, num_scheduled_tokens)
        return result

    def execute_model_(self, *args, **kwargs):
        try:
            return execute_model(self, *args, **kwargs)
        finally:
            ledger = _LEDGERS.get(self)
            if ledger is not None:
                ledger.step = []
                if ledger.recorded:
                    ledger.write_records(self)

    GPUModelRunner.initialize_kv_cache = initialize_kv_cache_
    GPUModelRunner._update_states = _update_states_
    GPUModelRunner._prepare_inputs = _prepare_inputs_
    GPUModelRunner.execute_model = execute_model_
    _installed.append(True)
