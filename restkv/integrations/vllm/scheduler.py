"""The scheduler side: give a compressed request's evicted blocks back to the pool, and size it by its slots.

* ``Scheduler.schedule``: before each schedule, every running request whose prompt was scheduled to its end
  (its prefill step has run or runs before any later one, the workers executing steps in order) and has not
  been compressed in this residency gives back the blocks past ``ceil(kept / block_size)``. The pool can hand
  them to any request at once.
* ``KVCacheManager.allocate_slots``: a compressed request holds ``num_computed_tokens - evicted`` slots (its
  positions run on from the prompt's true length, its slots from the kept tokens), so its blocks are counted
  from those.

What was evicted is recorded beside each request (a weak map) with the preemption count it belongs to: a
preempted request is freed whole, prefilled again and compressed again, exactly as the workers do
(``restkv.integrations.vllm.worker``).
"""

from __future__ import annotations

import weakref

from restkv.integrations.vllm.record import record_folder, write_blocks
from restkv.integrations.vllm.settings import VllmCompression

#: each request's ``(num_preemptions, evicted slots)``
_EVICTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_installed: list[bool] = []


def evicted_slots(request) -> int | None:
    """Slots ``request`` gave back in its present residency (None: not compressed in it yet)."""
    record = _EVICTED.get(request)
    if record is None or record[0] != request.num_preemptions:
        return None
    return record[1]


def release_evicted_blocks(scheduler, compression: VllmCompression, records=None) -> None:
    """Free the blocks of running requests whose prefill ended since the last schedule (module docstring);
    ``records``: a folder where each compressed request's blocks are written (``record.write_blocks``)."""
    coordinator = scheduler.kv_cache_manager.coordinator
    for request in scheduler.running:
        if evicted_slots(request) is not None or request.num_computed_tokens < request.num_prompt_tokens:
            continue
        evicted = compression.evicted_tokens(request.num_prompt_tokens)
        _EVICTED[request] = (request.num_preemptions, evicted)
        if evicted == 0:
            continue
        kept = request.num_computed_tokens - evicted
        for manager in coordinator.single_type_managers:
            blocks = manager.req_to_blocks.get(request.request_id)
            if not blocks:
                continue
            keep = -(-kept // manager.block_size)
            tail = blocks[keep:]
            del blocks[keep:]
            if request.request_id in manager.num_cached_block:
                manager.num_cached_block[request.request_id] = min(manager.num_cached_block[request.request_id], keep)
            manager.block_pool.free_blocks(reversed(tail))
            if records is not None:
                write_blocks(records, request.request_id, request.num_prompt_tokens, kept, len(blocks))


def install(compression: VllmCompression) -> None:
    """Patch vLLM's scheduler and KV cache manager in this process (idempotent)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    if _installed:
        return
    schedule, allocate_slots = Scheduler.schedule, KVCacheManager.allocate_slots
    records = record_folder()

    def schedule_(self, *args, **kwargs):
        release_evicted_blocks(self, compression, records)
        return schedule(self, *args, **kwargs)

    def allocate_slots_(self, request, *args, **kwargs):
        evicted = evicted_slots(request)
        if not evicted:
            return allocate_slots(self, request, *args, **kwargs)
        request.num_computed_tokens -= evicted
        try:
            return allocate_slots(self, request, *args, **kwargs)
        finally:
            request.num_computed_tokens += evicted

    Scheduler.schedule = schedule_
    KVCacheManager.allocate_slots = allocate_slots_
    _installed.append(True)
