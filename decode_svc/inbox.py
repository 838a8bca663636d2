"""Where a KV push and the Decode call that claims it meet, whichever arrives first.

The K/V itself is already in the engine's paged pool (Engine.park), counted like any running
sequence's; the inbox only knows which keys (request id + attempt) have arrived, which were
abandoned, and when K/V that nobody claimed must be dropped.
"""
from __future__ import annotations

import threading
import time
from typing import Callable


def seq_key(request_id: str, attempt: int) -> str:
    """The key of one attempt of a request, in the inbox and the engine ('#' cannot occur in a request id)."""
    return f"{request_id}#{attempt}"


class KVInbox:
    """key -> (arrival time, tokens) of K/V parked in the pool, until its Decode call takes it.

    K/V that nobody claims within `ttl_s` is dropped (`drop(key)` frees it in the engine), and so is
    K/V for a key whose Decode call already ended (a tombstone remembers the key for `ttl_s`). Keys
    are per attempt, so an abandoned attempt's tombstone never refuses the next attempt's push.
    """

    def __init__(self, ttl_s: float, drop: Callable[[str], None],
                 on_cancel: Callable[[str], None] = lambda key: None):
        self.ttl_s = ttl_s
        self._drop = drop
        self._on_cancel = on_cancel  # cancel(key) was called: a push of key still arriving is cut off
        self._cond = threading.Condition()
        self._arrived: dict[str, tuple[float, int]] = {}  # key -> (monotonic arrival, num_tokens)
        self._cancelled: dict[str, float] = {}
        # key -> (monotonic deadline, callback) of take_async() calls still waiting
        self._waiters: dict[str, tuple[float, Callable[[int | None], None]]] = {}
        self._abandoned = False  # abandon(): no K/V is coming any more

    def accepting(self, key: str) -> bool:
        """Whether a push for key may still be parked (checked before placing it in the pool)."""
        with self._cond:
            return key not in self._cancelled and key not in self._arrived

    def arrived(self, key: str, num_tokens: int) -> bool:
        """The key's K/V (of num_tokens tokens) is parked; False if its Decode call ended meanwhile
        (the caller frees it)."""
        with self._cond:
            if key in self._cancelled or key in self._arrived:
                return False
            waiter = self._waiters.pop(key, None)
            if waiter is None:
                self._arrived[key] = (time.monotonic(), num_tokens)
                self._cond.notify_all()
                return True
        waiter[1](num_tokens)
        return True

    def take(self, key: str, timeout_s: float, is_active=lambda: True) -> int | None:
        """Wait for the key's K/V; its number of tokens once it is parked (it is the caller's now),
        None on timeout or once is_active() turns False."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                entry = self._arrived.pop(key, None)
                if entry is not None:
                    return entry[1]
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not is_active() or self._abandoned:
                    return None
                self._cond.wait(min(remaining, 0.1))

    def take_async(self, key: str, timeout_s: float, callback: Callable[[int | None], None]) -> None:
        """take() without a waiting thread: callback(num_tokens) once the key's K/V is parked (on the
        thread that parks it, or on this one if it already is), callback(None) once timeout_s has passed
        (seen by sweep()) or the key is cancelled."""
        with self._cond:
            entry = self._arrived.pop(key, None)
            if entry is None and not self._abandoned:
                self._waiters[key] = (time.monotonic() + timeout_s, callback)
                return
        callback(entry[1] if entry is not None else None)

    def cancel(self, key: str) -> bool:
        """The key's Decode call ended: drop what is parked for it and refuse what comes later.
        Whether K/V was parked for it."""
        with self._cond:
            parked = self._arrived.pop(key, None) is not None
            waiter = self._waiters.pop(key, None)
            self._cancelled[key] = time.monotonic()
        if parked:
            self._drop(key)
        self._on_cancel(key)
        if waiter is not None:
            waiter[1](None)
        return parked

    def sweep(self) -> None:
        """Drop K/V unclaimed for ttl_s, and forget old tombstones."""
        now = time.monotonic()
        with self._cond:
            stale = [key for key, (t, _) in self._arrived.items() if now - t > self.ttl_s]
            for key in stale:
                del self._arrived[key]
            for key, t in list(self._cancelled.items()):
                if now - t > self.ttl_s:
                    del self._cancelled[key]
            expired = [self._waiters.pop(key)[1] for key, (deadline, _) in list(self._waiters.items())
                       if now >= deadline]
        for key in stale:
            self._drop(key)
        for callback in expired:
            callback(None)

    def abandon(self) -> None:
        """Nothing will be decoded here any more (the engine failed, and freed what was parked): forget the
        K/V that arrived, and every take_async() still waiting gets callback(None) now (no sweep would
        come to expire it)."""
        with self._cond:
            self._abandoned = True
            self._arrived.clear()
            waiters, self._waiters = list(self._waiters.values()), {}
            self._cond.notify_all()
        for _, callback in waiters:
            callback(None)

    @property
    def num_parked(self) -> int:
        return len(self._arrived)
