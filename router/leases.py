"""Keeping a router's KV reservations alive from the moment they are made until they are released."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from common.state import ReserveReason, StateStore, StateUnavailable

log = logging.getLogger(__name__)


@dataclass
class _Held:
    worker_id: str
    epoch: str
    num_blocks: int
    on_lost: Callable[[str], None]
    gone_since: float | None = None  # the worker was missing from the registry since then


class LeaseKeeper:
    """Renews every lease this router holds on one thread, every ttl/4, whatever phase its request is
    in (waiting for prefill, the KV push, admission or decoding), so no wait can outlive a lease.

    A lease that Redis no longer has (Redis restarted, or it expired while Redis was unreachable) is
    reserved again at once. When that is impossible (the worker restarted or is gone for a whole
    TTL, or the blocks were promised to someone else meanwhile) `on_lost(reason)` is called: the
    request must stop using those blocks (the router fails the attempt over).
    """

    def __init__(self, state: StateStore, ttl_s: float):
        self.state = state
        self.ttl_s = ttl_s
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._thread.start()

    def hold(self, request_id: str, worker_id: str, epoch: str, num_blocks: int,
             on_lost: Callable[[str], None]) -> None:
        with self._lock:
            self._held[request_id] = _Held(worker_id, epoch, num_blocks, on_lost)

    def drop(self, request_id: str) -> None:
        with self._lock:
            self._held.pop(request_id, None)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            with self._lock:
                held = list(self._held.items())
            for request_id, lease in held:
                try:
                    lost = self._keep(request_id, lease)
                except StateUnavailable as exc:
                    # Nobody can reserve while Redis is unreachable: keep trying; once it is back the
                    # lease is renewed or reserved again.
                    log.warning("cannot renew the lease of %s: %s", request_id, exc)
                    continue
                except Exception:  # noqa: BLE001 - one bad lease must not stop the others' renewal
                    log.exception("renewing the lease of %s failed", request_id)
                    continue
                if lost is not None:
                    with self._lock:
                        if self._held.get(request_id) is not lease:
                            continue  # released or replaced meanwhile
                        del self._held[request_id]
                    log.warning("lease of %s on %s lost: %s", request_id, lease.worker_id, lost)
                    lease.on_lost(lost)

    def _keep(self, request_id: str, lease: _Held) -> str | None:
        """Renew (or re-reserve) one lease; the reason it is lost, or None."""
        if self.state.renew(lease.worker_id, request_id, self.ttl_s):
            lease.gone_since = None
            return None
        result = self.state.reserve(lease.worker_id, lease.epoch, request_id, lease.num_blocks, self.ttl_s)
        if result.ok:
            with self._lock:
                dropped = self._held.get(request_id) is not lease
            if dropped:
                # The request ended (and released) while this reserve ran: undo it, or the blocks would
                # stay promised to nobody until the lease expired.
                self.state.release(lease.worker_id, request_id)
                return None
            log.info("lease of %s on %s reserved again (Redis had lost it)", request_id, lease.worker_id)
            lease.gone_since = None
            return None
        if result.reason == ReserveReason.WORKER_GONE:
            # After a Redis restart the worker re-registers within a heartbeat or two.
            now = time.monotonic()
            lease.gone_since = lease.gone_since or now
            if now - lease.gone_since < self.ttl_s:
                return None
            return f"decode worker {lease.worker_id} left the registry"
        if result.reason == ReserveReason.EPOCH_MISMATCH:
            return f"decode worker {lease.worker_id} restarted"
        return (f"Redis no longer held it and its {lease.num_blocks} blocks on {lease.worker_id} were "
                f"promised to other requests meanwhile")
