"""Choosing workers from the Redis registry and reserving decode capacity, with a bounded wait.

Coroutines on the router's event loop: each look at Redis runs on the blocking pool, and a request
waiting for room sleeps on the loop between looks, holding no thread.
"""
from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass

import grpc

from common import metrics, tracing
from common.engine.prefix import PrefixHasher
from common.grpc_common import ServiceError
from common.state import StateStore, WorkerInfo
from router.blocking import BlockingPool

log = logging.getLogger(__name__)


# A worker that failed a request is excluded for that request's retries by (worker_id, epoch): the
# same id restarted (a new epoch) is a new process and may take the retry.
Excluded = set[tuple[str, str]]


@dataclass(frozen=True)
class Lease:
    worker: WorkerInfo
    num_blocks: int


class WorkerPicker:
    def __init__(self, state: StateStore, blocking: BlockingPool, model_id: str, *, lease_ttl_s: float,
                 queue_timeout_s: float, max_queued: int, routing: str = "cache_aware", cache_balance: int = 4):
        self.state = state
        self.blocking = blocking
        self.model_id = model_id
        self.lease_ttl_s = lease_ttl_s
        self.queue_timeout_s = queue_timeout_s
        self.routing = routing
        self.cache_balance = cache_balance
        self._queue_slots = threading.BoundedSemaphore(max_queued)
        self._lock = threading.Lock()
        self._prefill_load: Counter[str] = Counter()  # requests this router has in flight per prefill worker
        # The prompts (their lengths in tokens, with how many of each) this router has sent to each prefill
        # worker whose first token has not come back: its prefill queue, as far as this router knows
        # (conditional placement reads it).
        self._prefill_queue: dict[str, Counter[int]] = {}
        self._warned: set[str] = set()

    def _live(self, role: str, exclude: Excluded) -> list[WorkerInfo]:
        workers = []
        for w in self.state.list_workers(role):
            if (w.worker_id, w.epoch) in exclude:
                continue
            if w.model_id != self.model_id:
                if w.worker_id not in self._warned:
                    self._warned.add(w.worker_id)
                    log.warning("ignoring %s worker %s: it serves model %s, this router serves %s",
                                role, w.worker_id, w.model_id, self.model_id)
                continue
            workers.append(w)
        return workers

    async def reserve_decode(self, request_id: str, num_tokens: int, deadline: float,
                             exclude: Excluded = frozenset(), trace=tracing.INVALID_SPAN) -> Lease:
        """Lease KV blocks for num_tokens on the decode worker with the most room; waits (bounded) for room.
        The wait, if there is one, is a `queue` span under `trace` (the request's reserve span)."""
        if not self._queue_slots.acquire(blocking=False):
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               "too many requests are already waiting for decode capacity; retry later")
        try:
            return await self._reserve(request_id, num_tokens,
                                       min(deadline, time.monotonic() + self.queue_timeout_s), exclude, trace)
        finally:
            self._queue_slots.release()

    async def _reserve(self, request_id: str, num_tokens: int, until: float, exclude: Excluded, trace) -> Lease:
        delay = 0.005
        largest = 0
        queue = None  # the `queue` span: from the first look that found no room to the end of the wait
        num_looks = 0

        def undo(found: tuple[Lease | None, list[WorkerInfo]]) -> None:
            # Reserved for a request cancelled meanwhile: nobody will hold or release this lease.
            if found[0] is not None:
                self.state.release(found[0].worker.worker_id, request_id)

        try:
            while True:
                lease, workers = await self.blocking.run(self._try_reserve, request_id, num_tokens, exclude,
                                                         undo=undo)
                num_looks += 1
                if lease is not None:
                    return lease
                if workers and all(-(-num_tokens // w.block_size) > w.total_blocks for w in workers):
                    # No retry can succeed: a bad request (400), not a full cluster (429, which clients retry).
                    pool_tokens = max(w.total_blocks * w.block_size for w in workers)
                    raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                                       f"max_tokens plus the prompt need KV for {num_tokens} tokens, more than the "
                                       f"largest decode worker's whole pool holds ({pool_tokens} tokens); lower "
                                       f"max_tokens by at least {num_tokens - pool_tokens}")
                largest = max([w.available_blocks or 0 for w in workers] + [0])
                if time.monotonic() >= until:
                    break
                if queue is None:
                    queue = tracing.start("queue", trace)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.1)
            if not workers:
                raise self._none_left("decode", exclude)
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"no decode worker has room for the KV of {num_tokens} tokens (prompt + max_tokens) "
                               f"after waiting {self.queue_timeout_s:.1f} s; the most free is {largest} blocks; "
                               f"retry later or lower max_tokens")
        finally:
            if queue is not None:  # how it ended is the reserve span's to say
                queue.set_attribute("handoff.looks", num_looks)
                queue.end()

    def _try_reserve(self, request_id: str, num_tokens: int,
                     exclude: Excluded) -> tuple[Lease | None, list[WorkerInfo]]:
        """One look at the registry (blocking): a lease on the decode worker with the most free blocks that
        takes it, or None; and the live decode workers."""
        workers = self._live("decode", exclude)
        # Most free blocks first; shuffle first so equal ones share the load.
        random.shuffle(workers)
        workers.sort(key=lambda w: w.available_blocks or 0, reverse=True)
        for w in workers:
            blocks = -(-num_tokens // w.block_size)
            if blocks > w.total_blocks:
                continue
            if (w.available_blocks or 0) < blocks:
                continue
            result = self.state.reserve(w.worker_id, w.epoch, request_id, blocks, self.lease_ttl_s)
            if result.ok:
                return Lease(w, blocks), workers
        return None, workers

    @staticmethod
    def _none_left(role: str, exclude: Excluded) -> ServiceError:
        """UNAVAILABLE: no worker of `role` to try. The ids of those that failed go to the log and the
        request record only (ServiceError.detail), never to the public client."""
        if exclude:
            failed = ", ".join(sorted(wid for wid, _ in exclude))
            left = "and no other (nor a restarted one) is registered; retry shortly"
            return ServiceError(grpc.StatusCode.UNAVAILABLE,
                                f"no {role} worker left to try: those tried failed this request {left}",
                                detail=f"no {role} worker left to try: {failed} failed this request {left}")
        return ServiceError(grpc.StatusCode.UNAVAILABLE,
                            f"no {role} worker is registered (none started, all down, or Redis was reset and "
                            f"they have not re-registered yet); retry shortly")

    async def pick_prefill(self, deadline: float, exclude: Excluded = frozenset(),
                           prompt_ids: list[int] | None = None) -> tuple[WorkerInfo, int]:
        """A prefill worker and the prompt tokens its prefix cache holds. When none is left (the only one
        died), waits for one to (re)start, up to queue_timeout_s or the deadline.

        cache_aware (SGLang's policy, Dynamo's KV router): among the workers whose load is within
        `cache_balance` requests of the least loaded, the one holding the longest prefix of the
        prompt (ties: the least loaded); least_loaded: the least loaded.
        """
        until = min(deadline, time.monotonic() + self.queue_timeout_s)
        while True:
            workers, cached = await self.blocking.run(self._prefill_candidates, exclude, prompt_ids)
            if workers or time.monotonic() >= until:
                break
            await asyncio.sleep(0.05)
        if not workers:
            raise self._none_left("prefill", exclude)
        with self._lock:
            load = {w.worker_id: (self._prefill_load[w.worker_id], w.num_waiting) for w in workers}
            least = min(load.values())
            near = [w for w in workers if load[w.worker_id][0] <= least[0] + self.cache_balance]
            best = min(near, key=lambda w: (-cached.get(w.worker_id, 0), load[w.worker_id]))
            self._prefill_load[best.worker_id] += 1
        hit = cached.get(best.worker_id, 0)
        metrics.ROUTED.labels("cache" if hit else "load").inc()
        return best, hit

    def _prefill_candidates(self, exclude: Excluded,
                            prompt_ids: list[int] | None) -> tuple[list[WorkerInfo], dict[str, int]]:
        """The live prefill workers (shuffled: equal ones share the load) and the prompt tokens each one's
        prefix cache holds (blocking: Redis, and hashing the prompt)."""
        workers = self._live("prefill", exclude)
        random.shuffle(workers)
        cached = self._cached_tokens(workers, prompt_ids) if self.routing == "cache_aware" and prompt_ids else {}
        return workers, cached

    def _cached_tokens(self, workers: list[WorkerInfo], prompt_ids: list[int]) -> dict[str, int]:
        """Prompt tokens each worker's published prefix cache holds (whole chunks)."""
        out: dict[str, int] = {}
        by_seed: dict[tuple[str, str, int, int], list[WorkerInfo]] = {}
        for w in workers:
            if w.prefix_seed and w.chunk_tokens:
                by_seed.setdefault((w.role, w.prefix_seed, w.block_size, w.chunk_tokens), []).append(w)
        for (role, seed, block_size, chunk), group in by_seed.items():
            hashes = PrefixHasher.from_seed(bytes.fromhex(seed), block_size=block_size,
                                            chunk_tokens=chunk).chunk_hashes(prompt_ids)
            if hashes:
                for wid, n in self.state.cached_prefix_chunks([w.worker_id for w in group], hashes, role).items():
                    out[wid] = n * chunk
        return out

    async def prefill_backlog(self, num_tokens: int, exclude: Excluded = frozenset()) -> int | None:
        """Prompt tokens a prompt of num_tokens would wait for on the least loaded live prefill worker: this
        router's queued prompts there (first token not back yet) of at most num_tokens, since a prefill
        worker runs the prompt with the fewest tokens left first (Engine._prefill_next_chunk; a longer one
        delays it by one chunk at most). None when no prefill worker this request may use is registered."""
        workers = await self.blocking.run(self._live, "prefill", exclude)
        if not workers:
            return None
        with self._lock:
            return min(sum(n * count for n, count in self._prefill_queue.get(w.worker_id, {}).items()
                           if n <= num_tokens) for w in workers)

    def queued_prefill(self, worker_id: str, num_tokens: int) -> "QueuedPrefill":
        """Counts a prompt of num_tokens in worker_id's prefill queue until the returned ticket is released."""
        with self._lock:
            self._prefill_queue.setdefault(worker_id, Counter())[num_tokens] += 1
        return QueuedPrefill(self, worker_id, num_tokens)

    def _dequeue_prefill(self, worker_id: str, num_tokens: int) -> None:
        with self._lock:
            queue = self._prefill_queue[worker_id]
            queue[num_tokens] -= 1
            if queue[num_tokens] <= 0:
                del queue[num_tokens]
            if not queue:
                del self._prefill_queue[worker_id]

    def done_prefill(self, worker_id: str) -> None:
        with self._lock:
            self._prefill_load[worker_id] -= 1
            if self._prefill_load[worker_id] <= 0:
                del self._prefill_load[worker_id]


class QueuedPrefill:
    """One prompt in a router's count of a prefill worker's queue; release() is idempotent."""

    def __init__(self, picker: WorkerPicker, worker_id: str, num_tokens: int):
        self._picker, self._worker_id, self._num_tokens = picker, worker_id, num_tokens
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._picker._dequeue_prefill(self._worker_id, self._num_tokens)
