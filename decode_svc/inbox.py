"""Where a KV push and the Decode call that claims it meet, whichever arrives first."""
from __future__ import annotations

import threading
import time

import torch


class KVInbox:
    """request_id -> received K/V, parked until its Decode call takes it.

    KV that nobody claims within `ttl_s` is dropped, and so is KV for a request that was
    cancelled before it arrived (a tombstone remembers the id for `ttl_s`).
    """

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._cond = threading.Condition()
        self._parked: dict[str, tuple[torch.Tensor, float]] = {}
        self._cancelled: dict[str, float] = {}

    def deliver(self, request_id: str, kv: torch.Tensor) -> bool:
        """Park the KV; False (and dropped) if the request was cancelled or already delivered."""
        with self._cond:
            self._expire(time.monotonic())
            if request_id in self._cancelled or request_id in self._parked:
                return False
            self._parked[request_id] = (kv, time.monotonic())
            self._cond.notify_all()
            return True

    def take(self, request_id: str, timeout_s: float, is_active=lambda: True) -> torch.Tensor | None:
        """Wait for the request's KV; None on timeout or once is_active() turns False."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            # A Decode waiting for this id again (the router's retry after a failed attempt) lifts the
            # tombstone the cancelled attempt left, or the retry's KV would be refused.
            self._cancelled.pop(request_id, None)
            while True:
                entry = self._parked.pop(request_id, None)
                if entry is not None:
                    return entry[0]
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not is_active():
                    return None
                self._cond.wait(min(remaining, 0.1))

    def cancel(self, request_id: str) -> None:
        with self._cond:
            self._parked.pop(request_id, None)
            self._cancelled[request_id] = time.monotonic()

    def _expire(self, now: float) -> None:
        for rid, (_, t) in list(self._parked.items()):
            if now - t > self.ttl_s:
                del self._parked[rid]
        for rid, t in list(self._cancelled.items()):
            if now - t > self.ttl_s:
                del self._cancelled[rid]

    def sweep(self) -> None:
        with self._cond:
            self._expire(time.monotonic())

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    @property
    def parked_bytes(self) -> int:
        return sum(kv.numel() * kv.element_size() for kv, _ in self._parked.values())
