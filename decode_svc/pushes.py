"""The KV pushes a decode worker is receiving, and the memory their buffers hold until they land.

A push allocates its whole buffer when its header arrives, before a byte of K/V. Each is admitted only
under its request's live lease, and counted against it: the pushes of one request together hold at most
what its lease covers, and all of them at most the pool, so a sender (a misbehaving prefill worker, one
attempt's push still running beside the next one's) pins no more memory than the reservations it holds.
A push whose lease has ended (released, expired), or whose attempt the router dropped, is cut off (its
RPC cancelled, its buffer freed) instead of holding its buffer until its own deadline.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from common.grpc_common import ServiceError

# A push whose request has had no live lease for this long is cut off. Not at once: after a Redis restart
# the routers reserve their leases again within a round of their lease keeper.
LEASE_GRACE_S = 5.0


@dataclass(eq=False)
class Push:
    key: str  # request id + attempt (inbox.seq_key)
    request_id: str
    num_bytes: int  # the buffer its header made this worker allocate
    cancel: Callable[[], None]  # cancels its RPC
    since: float = field(default_factory=time.monotonic)  # admitted
    unleased_since: float | None = None  # first seen without a live lease
    was_cut: bool = False  # cut off here (its RPC cancelled), not failed by its sender

    def cut(self) -> None:
        self.was_cut = True
        self.cancel()


class PushesInFlight:
    """Pushes admitted (their header accepted) and not yet landed or failed, with the bytes they hold."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes  # all pushes together: the pool's worth of K/V
        self._lock = threading.Lock()
        self._pushes: set[Push] = set()

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return sum(p.num_bytes for p in self._pushes)

    def __len__(self) -> int:
        return len(self._pushes)

    def admit(self, key: str, request_id: str, num_bytes: int, lease_bytes: int,
              cancel: Callable[[], None]) -> Push:
        """Count a push's buffer, or refuse it (RESOURCE_EXHAUSTED) if its request's pushes would hold more
        than its lease covers (lease_bytes), or all pushes more than the pool."""
        with self._lock:
            held = sum(p.num_bytes for p in self._pushes if p.request_id == request_id)
            if held + num_bytes > lease_bytes:
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"KV push of {request_id} refused: with the {held} bytes its pushes in flight "
                                   f"hold already, its {num_bytes} bytes exceed the {lease_bytes} its lease covers")
            total = sum(p.num_bytes for p in self._pushes)
            if total + num_bytes > self.max_bytes:
                raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"KV push of {request_id} refused: pushes in flight hold {total} bytes, its "
                                   f"{num_bytes} more would exceed the pool's {self.max_bytes}")
            push = Push(key, request_id, num_bytes, cancel)
            self._pushes.add(push)
            return push

    def done(self, push: Push) -> None:
        """The push landed or failed: its buffer is no longer this registry's to count."""
        with self._lock:
            self._pushes.discard(push)

    def cut(self, key: str) -> None:
        """Cut off the pushes of key (its attempt was dropped: nobody will claim the K/V)."""
        with self._lock:
            pushes = [p for p in self._pushes if p.key == key]
        for push in pushes:
            push.cut()

    def cut_unleased(self, leased: set[str], seen_at: float) -> None:
        """leased: the request ids with a live lease here, as read at seen_at (time.monotonic(), before the
        read). A push admitted before then whose request was not among them for LEASE_GRACE_S is cut off."""
        cut = []
        with self._lock:
            for push in self._pushes:
                if push.request_id in leased or push.since >= seen_at:
                    push.unleased_since = None
                    continue
                push.unleased_since = push.unleased_since or seen_at
                if seen_at - push.unleased_since >= LEASE_GRACE_S:
                    cut.append(push)
        for push in cut:
            push.cut()
