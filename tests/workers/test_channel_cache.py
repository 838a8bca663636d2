"""grpc_common.ChannelCache: one channel per (address, epoch), so that a worker restarted at the same address
is reached at once, not after the dead process's channel has waited out its reconnect backoff."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common import grpc_common
from common.ports import free_port


def _health_server(port: int) -> grpc.Server:
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return grpc_common.serve_health(servicer, "127.0.0.1", port)


def _check(ch: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status


def test_a_peer_restarted_at_the_same_address_is_reached_through_a_fresh_channel():
    port = free_port()
    address = f"127.0.0.1:{port}"
    cache = grpc_common.ChannelCache()
    first = _health_server(port)
    try:
        with cache.use(address, "epoch-1") as ch:
            assert _check(ch) == health_pb2.HealthCheckResponse.SERVING
    finally:
        first.stop(None).wait()
    for _ in range(3):  # the dead peer: the channel fails, and backs off before reconnecting
        with cache.use(address, "epoch-1") as ch, pytest.raises(grpc.RpcError) as err:
            _check(ch)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    second = _health_server(port)  # restarted: same address, new epoch
    try:
        with cache.use(address, "epoch-2") as ch:
            assert _check(ch) == health_pb2.HealthCheckResponse.SERVING
        assert list(cache._channels) == [(address, "epoch-2", 0)]  # old epoch closed (0: TLS generation)
    finally:
        second.stop(None).wait()
        cache.close()
