"""The router's LeaseKeeper against a real Redis: leases live from reservation to release, are
reserved again when Redis loses them, and are reported lost when they cannot be."""
from __future__ import annotations

import time
import uuid

import pytest

from common.redis_server import EmbeddedRedis, connect
from common.state import StateStore, WorkerInfo
from router.leases import LeaseKeeper

TTL_S = 0.6


@pytest.fixture
def redis_server():
    with EmbeddedRedis() as srv:
        yield srv


@pytest.fixture
def store(redis_server):
    client, _ = connect(redis_server.url)
    yield StateStore(client, prefix=f"test-{uuid.uuid4().hex[:8]}:")
    client.close()


def register(store, epoch="e1", total_blocks=10):
    store.register(WorkerInfo(worker_id="d0", role="decode", address="a:1", kv_address="a:2", epoch=epoch,
                              model_id="m", total_blocks=total_blocks, free_blocks=total_blocks, num_running=0,
                              num_waiting=0, started_at=time.time()), ttl_s=30)


def keep(store, rid="r1", blocks=4):
    lost: list[str] = []
    keeper = LeaseKeeper(store, TTL_S)
    assert store.reserve("d0", "e1", rid, blocks, TTL_S).ok
    keeper.hold(rid, "d0", "e1", blocks, lost.append)
    return keeper, lost


def test_a_held_lease_outlives_many_ttls_and_goes_with_its_release(store):
    register(store)
    keeper, lost = keep(store)
    try:
        time.sleep(5 * TTL_S)
        assert store.reservations("d0") == {"r1": 4} and not lost
        keeper.drop("r1")
        store.release("d0", "r1")
        time.sleep(2 * TTL_S)
        assert store.reservations("d0") == {}
    finally:
        keeper.close()


def test_a_lease_redis_lost_is_reserved_again(store, redis_server):
    register(store)
    keeper, lost = keep(store)
    try:
        redis_server.restart()  # empty: the worker entry and the lease are gone
        register(store)  # the worker's next heartbeat
        deadline = time.monotonic() + 5 * TTL_S
        while store.reservations("d0") != {"r1": 4}:
            assert time.monotonic() < deadline, "the lease was not reserved again"
            time.sleep(0.05)
        assert not lost
    finally:
        keeper.close()


def test_a_lease_that_cannot_be_reserved_again_is_reported_lost(store):
    register(store)
    keeper, lost = keep(store)
    try:
        register(store, epoch="e2")  # the decode worker restarted: its old pool is gone
        deadline = time.monotonic() + 5 * TTL_S
        while not lost:
            assert time.monotonic() < deadline, "a lease on a restarted worker was not reported lost"
            time.sleep(0.05)
        assert "restarted" in lost[0]
        assert keeper.num_held == 0
    finally:
        keeper.close()


def test_blocks_promised_to_others_meanwhile_mean_the_lease_is_lost(store):
    register(store, total_blocks=4)
    keeper, lost = keep(store, blocks=4)
    try:
        store.release("d0", "r1")  # as if it had expired while Redis was unreachable ...
        assert store.reserve("d0", "e1", "other", 4, ttl_s=30).ok  # ... and someone took the blocks
        deadline = time.monotonic() + 5 * TTL_S
        while not lost:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "promised to other requests" in lost[0]
    finally:
        keeper.close()
