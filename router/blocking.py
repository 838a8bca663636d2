"""The router's fixed pool of threads for blocking work (Redis calls, tokenization), off its event loop.

The router's requests are coroutines on one event loop; a blocking call there would stall every
stream. StateStore is synchronous (redis-py), so its calls run here, on a few threads whatever the
number of requests in flight.
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


async def to_the_end(aw: Awaitable[T]) -> T:
    """Await `aw` to its end even when the awaiting task is cancelled meanwhile, then raise that
    cancellation. A Redis write the router started (a record, a reservation) is then known to be done
    or failed before the request's cancellation runs its cleanup, never in flight behind it."""
    fut = asyncio.ensure_future(aw)
    cancelled = False
    while not fut.done():
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return fut.result()


class BlockingPool:
    def __init__(self, num_threads: int):
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="router-blocking")

    async def run(self, fn: Callable[..., T], *args, undo: Callable[[T], object] | None = None, **kw) -> T:
        """fn(*args, **kw) on the pool, awaited to its end (`to_the_end`: a thread cannot be interrupted).
        When the caller was cancelled meanwhile, `undo(result)` runs on the pool for the result nobody will
        use (a reservation made for a request that is gone) before the cancellation is raised."""
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._pool, functools.partial(fn, *args, **kw))
        try:
            return await to_the_end(fut)
        except asyncio.CancelledError:
            if undo is not None and not fut.cancelled() and fut.exception() is None:
                await to_the_end(loop.run_in_executor(self._pool, undo, fut.result()))
            raise

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
