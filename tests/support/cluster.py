"""An in-process cluster at rest (every pool free, nothing parked, no lease left), and a stream read on a thread."""
from __future__ import annotations

import threading
import time

import grpc

from protos import handoff_pb2

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



def stream_in_background(stub, request: handoff_pb2.GenerateRequest,
                         timeout_s: float = 300) -> tuple[dict, threading.Thread]:
    """A Generate call read on a thread of its own (started): got["ids"] and got["times"] grow as tokens
    arrive (their arrival times, time.monotonic()), got["error"] = (code, details) if it fails."""
    got: dict = {"ids": [], "times": []}

    def stream() -> None:
        try:
            for msg in stub.Generate(request, timeout=timeout_s):
                got["ids"] += msg.token_ids
                got["times"].append(time.monotonic())
        except grpc.RpcError as exc:
            got["error"] = (exc.code(), exc.details())

    thread = threading.Thread(target=stream)
    thread.start()
    return got, thread
