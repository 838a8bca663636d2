"""What a public client learns from a failure: what it can act on, and its request id. The Redis URL,
worker ids and addresses and downstream exception text stay in the router's log and the request's
Redis record (HGETALL handoff:request:<id>), where an operator looks them up by that id.

A real router (tokenizer and model shape only, no weights) against a real embedded Redis; the workers
it tries are registry entries whose addresses nothing listens on, as a crashed pod's are for a while.
"""
from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import grpc
import pytest

from common.redis_server import EmbeddedRedis, connect
from common.state import StateStore, WorkerInfo
from protos import handoff_pb2, handoff_pb2_grpc
from router.config import RouterConfig
from router.server import RouterServer

SECRET = "secret-worker"  # every fake worker's id starts with it


@pytest.fixture
def dead_ports():
    """Ports bound and not listening: connecting is refused, and no other process (other tests on the
    machine) can listen there while the test runs."""
    held: list[socket.socket] = []

    def address() -> str:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        held.append(s)
        return f"127.0.0.1:{s.getsockname()[1]}"
    yield address
    for s in held:
        s.close()


@pytest.fixture
def redis():
    server = EmbeddedRedis().start()
    yield server
    server.stop()


@pytest.fixture
def router(redis):
    client, _ = connect(redis.url)
    server = RouterServer(RouterConfig(host="127.0.0.1", port=0, http_port=0, queue_timeout_s=1.0, max_attempts=3,
                                       redis_url=redis.url), StateStore(client)).start()
    yield server
    server.stop(grace_s=1)


def _register_dead_workers(router: RouterServer, dead_address) -> list[str]:
    """Three decode and three prefill workers of the router's model, at addresses nothing listens on."""
    addresses = []
    for role in ("decode", "prefill"):
        for i in range(3):
            address = dead_address()
            addresses.append(address)
            router.state.heartbeat(WorkerInfo(
                worker_id=f"{SECRET}-{role}-{i}", role=role, address=address,
                kv_address=address if role == "decode" else "", epoch=f"epoch{i}", model_id=router.router.weights_id,
                total_blocks=1000, free_blocks=1000, num_running=0, num_waiting=0, started_at=time.time()),
                ttl_s=120)
    return addresses


def _generate(router: RouterServer, rid: str) -> grpc.RpcError:
    with grpc.insecure_channel(f"127.0.0.1:{router.port}") as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(handoff_pb2_grpc.RouterStub(ch).Generate(
                handoff_pb2.GenerateRequest(prompt="Hello there", max_tokens=4, request_id=rid), timeout=60))
    return err.value


def _http(router: RouterServer, rid: str) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{router.http_port}/v1/completions", method="POST",
                                     data=json.dumps({"prompt": "Hello there", "max_tokens": 4}).encode(),
                                     headers={"X-Request-Id": rid, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())["error"]["message"]


def _assert_discloses_nothing(message: str, secrets: list[str]) -> None:
    for secret in secrets:
        assert secret not in message, f"{secret!r} reached the client: {message}"


def test_every_attempt_failed_names_no_worker_and_no_address(router, dead_ports):
    addresses = _register_dead_workers(router, dead_ports)
    secrets = [SECRET, "127.0.0.1", *(a.rsplit(":", 1)[1] for a in addresses)]
    rid = f"dead-{time.monotonic_ns()}"
    err = _generate(router, rid)
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
    _assert_discloses_nothing(err.details(), secrets)
    assert rid in err.details() and "retry" in err.details()
    record = router.state.get_request(rid)
    assert SECRET in record["error"], record  # the operator's copy keeps what failed where
    http_rid = f"dead-http-{time.monotonic_ns()}"
    status, message = _http(router, http_rid)
    assert status == 503, message
    _assert_discloses_nothing(message, secrets)
    assert http_rid in message


def test_redis_unreachable_names_no_address(router, redis):
    port = redis.url.rsplit(":", 1)[1].split("/")[0]
    redis.stop()
    rid = f"no-redis-{time.monotonic_ns()}"
    err = _generate(router, rid)
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
    assert "Redis" in err.details() and rid in err.details()
    _assert_discloses_nothing(err.details(), ["redis://", "127.0.0.1", port])
    status, message = _http(router, f"no-redis-http-{time.monotonic_ns()}")
    assert status == 503 and "Redis" in message, message
    _assert_discloses_nothing(message, ["redis://", "127.0.0.1", port])
