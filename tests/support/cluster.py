"""An in-process cluster at rest: every pool free, nothing parked, no lease left."""
from __future__ import annotations

import time

def wait_idle(cluster, timeout_s: float = 15.0) -> None:
    """An in-process cluster at rest: every pool all-free and consistent, no KV parked, no sequence
    left, and no lease left in Redis; raises the last failed check after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            cluster.check_integrity()
            for w in cluster.decode:
                # The sweep drops only KV older than the KV wait (30 s): anything parked now was leaked
                # by a push nobody claimed, and must not be there.
                w.inbox.sweep()
                assert w.engine.num_parked == 0 and w.inbox.num_parked == 0, \
                    f"{w.config.worker_id}: KV of {w.engine.num_parked} pushes left parked"
            for w in cluster.decode + cluster.prefill:
                pool = w.engine.pool
                assert pool.num_free_blocks == pool.num_blocks, \
                    f"{w.config.worker_id}: {pool.num_used_blocks} KV blocks still used"
                assert w.engine.num_active == 0, f"{w.config.worker_id}: {w.engine.num_active} sequences left"
            for w in cluster.decode:
                leases = cluster.state.reservations(w.config.worker_id)
                assert not leases, f"{w.config.worker_id}: reservations left in Redis: {leases}"
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)

