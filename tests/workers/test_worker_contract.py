"""The workers' side of the failure semantics, in the default dtype (bf16, packed int4 decode):
failures charged to the worker that failed (trailers), no KV pushed that nobody will claim, work taken
only under a lease, pushes and health with room while Decode streams fill the pool, a heartbeat that
outlives Redis refusing commands with health that follows the registration, and clear errors for
ports another worker already uses."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import grpc_common
from common.redis_server import EmbeddedRedis, connect
from common.state import StateStore
from common.pb_convert import sampling_to_pb
from common.engine.sampling import SamplingParams
from common.kv_wire import encode_kv
from decode_svc.worker import DecodeWorker
from protos import internal_pb2, internal_pb2_grpc
from router.cluster import Cluster

REPO = Path(__file__).resolve().parents[2]
PROMPT = [1, 504, 3458, 282, 253, 2415, 314, 253, 12149]  # any token ids will do
LONG = (PROMPT * 90)[:3 * 256 + 21]  # four prefill chunks of the default 256 tokens: a streamed push


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(num_prefill=1, num_decode=1, kv_memory_gib=0.06, threads=1).start()
    yield c
    c.stop()


def health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def prefill(cluster, rid: str, *, max_tokens: int = 8, output_ids=(), epoch=None, kv_address=None,
            reserve: bool = True, attempt: int = 1, prompt=PROMPT):
    """A Prefill call straight to the prefill worker (what the router sends), under a lease on decode-0."""
    d = cluster.decode[0]
    if reserve:
        blocks = -(-(len(prompt) + max_tokens) // d.config.block_size)
        assert cluster.state.reserve(d.config.worker_id, d.epoch, rid, blocks, ttl_s=30).ok
    target = internal_pb2.KVTarget(worker_id=d.config.worker_id, kv_address=kv_address or d.kv_address,
                                   epoch=epoch or d.epoch, reservation_id=rid, attempt=attempt)
    request = internal_pb2.PrefillRequest(
        request_id=rid, prompt_ids=prompt, output_ids=list(output_ids), target=target,
        sampling=sampling_to_pb(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), 0))
    ch = grpc.insecure_channel(cluster.prefill[0].address)
    try:
        return list(internal_pb2_grpc.PrefillWorkerStub(ch).Prefill(request, timeout=30))
    finally:
        ch.close()


def wait_parked(decode: DecodeWorker, count: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while decode.engine.num_parked != count:
        assert time.monotonic() < deadline, f"{decode.engine.num_parked} parked, expected {count}"
        time.sleep(0.02)


def release_all(cluster) -> None:
    d = cluster.decode[0]
    for rid in cluster.state.reservations(d.config.worker_id):
        cluster.state.release(d.config.worker_id, rid)


def test_a_first_token_that_ends_the_request_pushes_no_kv(cluster):
    d = cluster.decode[0]
    events = prefill(cluster, f"one-{time.monotonic_ns()}", max_tokens=1)
    assert len(events) == 1 and events[0].first_token.finished
    assert d.engine.num_parked == 0 and d.inbox.num_parked == 0


def test_a_streamed_push_whose_first_token_ends_the_request_leaves_no_kv(cluster):
    """A long prompt's push starts while it prefills; a first token that ends the request abandons it, and
    the decode worker drops what had arrived: nothing parked, the pool whole."""
    d = cluster.decode[0]
    free = d.engine.pool.num_free_blocks
    events = prefill(cluster, f"one-long-{time.monotonic_ns()}", max_tokens=1, prompt=LONG)
    assert len(events) == 1 and events[0].first_token.finished
    deadline = time.monotonic() + 10
    while d.num_inflight or d.engine.pool.num_free_blocks != free:
        assert time.monotonic() < deadline, f"{d.num_inflight} calls, {free - d.engine.pool.num_free_blocks} blocks"
        time.sleep(0.02)
    assert d.engine.num_parked == 0 and d.inbox.num_parked == 0
    release_all(cluster)


def test_a_long_prompt_streams_its_kv_while_it_prefills_with_the_same_bits(cluster):
    """One segment per prefill chunk, sent as each is computed: what the decode worker parks is bit for bit
    what the push after the prefill parks, the first token is the same, and less of the transfer is left
    after the first token than the whole push takes."""
    d, p = cluster.decode[0], cluster.prefill[0]
    chunk = p.config.prefill_chunk_tokens
    got = {}
    try:
        for stream in (True, False):
            p.stream_kv = stream
            rid = f"stream-{stream}-{time.monotonic_ns()}"
            events = prefill(cluster, rid, prompt=LONG)
            assert [e.WhichOneof("event") for e in events] == ["first_token", "transfer_done"]
            done = events[1].transfer_done
            assert done.num_segments == (-(-len(LONG) // chunk) if stream else 1)
            assert done.kv_bytes == d.fingerprint().kv_bytes(len(LONG))
            assert done.exposed_s > 0 and (done.exposed_s < done.transfer_s or not stream)
            wait_parked(d, 1)
            got[stream] = (events[0].first_token.token_id, d.engine.runner.cache.export_seq(f"{rid}#1", len(LONG)),
                           done)
            d.inbox.cancel(f"{rid}#1")
            wait_parked(d, 0)
            release_all(cluster)
    finally:
        p.stream_kv = p.config.stream_kv
    (tok_s, kv_s, done_s), (tok_p, kv_p, _) = got[True], got[False]
    assert tok_s == tok_p
    assert torch.equal(kv_s.view(torch.uint8), kv_p.view(torch.uint8))
    # Streamed, most of the transfer happened during the prefill (2 of its 4 chunks' time at least).
    assert done_s.transfer_s - done_s.exposed_s > events[0].first_token.prefill_s / 2
    release_all(cluster)


def test_a_push_parks_kv_in_the_pool_until_its_decode_or_the_wait_ends(cluster):
    d = cluster.decode[0]
    free = d.engine.pool.num_free_blocks
    events = prefill(cluster, f"park-{time.monotonic_ns()}")
    assert [e.WhichOneof("event") for e in events] == ["first_token", "transfer_done"]
    assert not events[0].first_token.finished
    wait_parked(d, 1)
    assert d.engine.pool.num_free_blocks < free  # counted in the pool, not beside it
    d.inbox.ttl_s, ttl = 0.0, d.inbox.ttl_s  # nobody claims it: the next sweep drops it
    try:
        d.inbox.sweep()
        wait_parked(d, 0)
    finally:
        d.inbox.ttl_s = ttl
    assert d.engine.pool.num_free_blocks == free
    release_all(cluster)


def test_a_resumed_prefill_pushes_without_sampling(cluster):
    rid = f"resume-{time.monotonic_ns()}"
    events = prefill(cluster, rid, output_ids=[11, 12, 13], attempt=2)
    assert [e.WhichOneof("event") for e in events] == ["transfer_done"]
    assert events[0].transfer_done.kv_bytes == cluster.decode[0].fingerprint().kv_bytes(len(PROMPT))  # the prompt's
    wait_parked(cluster.decode[0], 1)
    cluster.decode[0].inbox.cancel(f"{rid}#1")  # another attempt's key: nothing happens
    assert cluster.decode[0].engine.num_parked == 1
    cluster.decode[0].inbox.cancel(f"{rid}#2")  # its Decode call ended: the parked KV goes
    wait_parked(cluster.decode[0], 0)
    release_all(cluster)


def test_a_colocated_decode_of_a_pushed_attempt_is_refused_and_its_kv_dropped(cluster):
    """An attempt is pushed or prefilled here, never both: a prefill_here Decode for a key whose K/V is
    parked fails with INVALID_ARGUMENT (not INTERNAL from the pool) and the parked blocks are freed."""
    d = cluster.decode[0]
    free = d.engine.pool.num_free_blocks
    rid = f"both-{time.monotonic_ns()}"
    prefill(cluster, rid)
    wait_parked(d, 1)
    request = internal_pb2.DecodeRequest(
        request_id=rid, epoch=d.epoch, prompt_ids=PROMPT, attempt=1, prefill_here=True,
        sampling=sampling_to_pb(SamplingParams(temperature=0.0, max_tokens=4), 0))
    with grpc.insecure_channel(d.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(internal_pb2_grpc.DecodeWorkerStub(ch).Decode(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert "prefill_here" in err.value.details() and "dropped" in err.value.details()
    wait_parked(d, 0)
    assert d.inbox.num_parked == 0 and d.engine.pool.num_free_blocks == free
    release_all(cluster)


@pytest.mark.parametrize("prompt", ["short", "streamed"])
@pytest.mark.parametrize("fault", ["stale epoch", "no lease", "dead address"])
def test_a_failed_push_is_charged_to_the_decode_worker(cluster, fault, prompt):
    """The prefill worker did its part: the status it returns names the decode worker in its trailers,
    so the router excludes the decode worker, not the prefill worker (the only one, here)."""
    d = cluster.decode[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens once the socket closes
    kw = {"stale epoch": dict(epoch="an-old-epoch"), "no lease": dict(reserve=False),
          "dead address": dict(kv_address=dead)}[fault]
    with pytest.raises(grpc.RpcError) as err:
        prefill(cluster, f"blame-{time.monotonic_ns()}", prompt=LONG if prompt == "streamed" else PROMPT, **kw)
    code = err.value.code()
    assert code == (grpc.StatusCode.UNAVAILABLE if fault == "dead address" else grpc.StatusCode.FAILED_PRECONDITION)
    role, worker_id, epoch = grpc_common.blamed(err.value)
    assert (role, worker_id) == ("decode", d.config.worker_id)
    assert epoch == kw.get("epoch", d.epoch)
    assert d.engine.num_parked == 0
    release_all(cluster)


@pytest.mark.parametrize("prompt", ["short", "streamed"])
def test_kv_the_pool_cannot_take_is_refused_at_once_and_charged_to_the_decode_worker(cluster, prompt, monkeypatch):
    """The decode worker's engine cannot copy a push's K/V into its pool (here the K/V is made to be on another
    device, "meta"; on a GPU: a device error, out of device memory, or, before the copy was explicit, any
    host K/V into a CUDA pool). The push is refused at once with UNAVAILABLE, charged to the decode worker in
    the Prefill call's trailers, its blocks freed, and the engine serves on. It used to kill the engine
    thread: the push then timed out as INTERNAL, charged to the prefill worker."""
    d = cluster.decode[0]
    cache = d.engine.runner.cache
    real_import = cache.import_seq
    monkeypatch.setattr(cache, "import_seq", lambda seq_id, kv, start=0: real_import(seq_id, kv.to("meta"), start))
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        prefill(cluster, f"alien-{time.monotonic_ns()}", prompt=LONG if prompt == "streamed" else PROMPT)
    refused_s = time.monotonic() - t0
    monkeypatch.undo()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert grpc_common.blamed(err.value) == ("decode", d.config.worker_id, d.epoch)
    assert "cannot be placed" in err.value.details() and "meta" in err.value.details()
    assert refused_s < d.config.kv_wait_s / 2  # answered, not timed out
    assert d.engine.failure is None and d.engine.num_parked == 0
    assert d.engine.pool.num_free_blocks == d.engine.pool.num_blocks
    release_all(cluster)
    rid = f"after-alien-{time.monotonic_ns()}"
    assert [e.WhichOneof("event") for e in prefill(cluster, rid)] == ["first_token", "transfer_done"]
    wait_parked(d, 1)
    d.inbox.cancel(f"{rid}#1")
    wait_parked(d, 0)
    release_all(cluster)


def test_pushes_and_health_have_room_while_decode_streams_fill_the_pool(cluster):
    """Every block leased to a waiting Decode stream (the most the leases allow): the health check on
    the main port and a KV push on the KV port still go through, and the push is decoded."""
    d = cluster.decode[0]
    n = d.engine.pool.num_blocks
    assert d.max_rpcs() > n  # the main server admits every leased stream and then some
    rids = [f"fill-{i}-{time.monotonic_ns()}" for i in range(n)]
    for rid in rids:
        assert cluster.state.reserve(d.config.worker_id, d.epoch, rid, 1, ttl_s=60).ok
    sampling = sampling_to_pb(SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), 0)
    ch = grpc.insecure_channel(d.address)
    calls = [internal_pb2_grpc.DecodeWorkerStub(ch).Decode(internal_pb2.DecodeRequest(
        request_id=rid, epoch=d.epoch, prompt_ids=PROMPT[:4], output_ids=[7], attempt=1, sampling=sampling,
        kv_wait_s=60), timeout=60) for rid in rids]
    try:
        deadline = time.monotonic() + 20
        while d.num_inflight < n:
            assert time.monotonic() < deadline, f"only {d.num_inflight} of {n} Decode streams running"
            time.sleep(0.05)
        assert health(d.address) == health_pb2.HealthCheckResponse.SERVING
        assert health(d.address, grpc_common.LIVENESS) == health_pb2.HealthCheckResponse.SERVING
        # One more Decode without a lease is refused at once, not queued.
        with pytest.raises(grpc.RpcError) as err:
            list(internal_pb2_grpc.DecodeWorkerStub(ch).Decode(internal_pb2.DecodeRequest(
                request_id="no-lease", epoch=d.epoch, prompt_ids=PROMPT[:4], output_ids=[7], attempt=1,
                sampling=sampling), timeout=10))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # The push for the first stream lands on the KV server and that stream decodes.
        import torch
        from common.kv_wire import encode_kv
        fp = d.fingerprint()
        kv = torch.zeros(fp.num_layers, 2, 4, fp.num_kv_heads, fp.head_dim, dtype=fp.torch_dtype)
        with grpc.insecure_channel(d.kv_address) as kv_ch:
            internal_pb2_grpc.KVTransferStub(kv_ch).PushKV(
                encode_kv(kv, request_id=rids[0], target_worker_id=d.config.worker_id, target_epoch=d.epoch,
                          fingerprint=fp, attempt=1), timeout=30)
        tokens = [t for ev in calls[0] for t in ev.token_ids]
        assert len(tokens) == 2  # max_tokens 3, the first one was output_ids
    finally:
        for call in calls:
            call.cancel()
        ch.close()
        for rid in rids:
            cluster.state.release(d.config.worker_id, rid)
    deadline = time.monotonic() + 10
    while d.engine.pool.num_free_blocks != d.engine.pool.num_blocks or d.num_inflight:
        assert time.monotonic() < deadline, "blocks or streams left after the cancels"
        time.sleep(0.05)


def _stalled_push(d: DecodeWorker, rid: str, attempt: int, num_tokens: int):
    """A push that sends its header (the decode worker allocates the whole buffer then) and nothing more, as a
    sender that hangs or misbehaves: its call (a future) and the event that lets the sender go."""
    fp = d.fingerprint()
    kv = torch.zeros(fp.num_layers, 2, num_tokens, fp.num_kv_heads, fp.head_dim, dtype=fp.torch_dtype)
    header = next(encode_kv(kv, request_id=rid, target_worker_id=d.config.worker_id, target_epoch=d.epoch,
                            fingerprint=fp, attempt=attempt))
    gone = threading.Event()

    def messages():
        yield header
        gone.wait(120)

    ch = grpc.insecure_channel(d.kv_address)
    return internal_pb2_grpc.KVTransferStub(ch).PushKV.future(messages(), timeout=120), gone, ch


def _ended(call, timeout_s: float) -> grpc.RpcError | None:
    """The failure the call ended with within timeout_s; None if it is still open."""
    try:
        call.result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        return None
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("a push of a header alone succeeded")


def test_pushes_in_flight_are_bounded_by_their_lease_and_cut_off_when_it_ends(cluster):
    """A push's buffer is allocated when its header arrives. The pushes of one request together may hold
    what its lease covers, no more: a second whole-lease push for it is refused at its header (a
    misbehaving prefill worker pinned one buffer per push). A push whose lease ends, or whose attempt the
    router drops, is cut off and its buffer freed, instead of being held until the push's deadline."""
    d = cluster.decode[0]
    tokens = 4 * d.config.block_size
    opened = []
    try:
        rid = f"pinned-{time.monotonic_ns()}"
        assert cluster.state.reserve(d.config.worker_id, d.epoch, rid, 4, ttl_s=60).ok
        pushes = [_stalled_push(d, rid, attempt, tokens) for attempt in (1, 2)]
        opened += pushes
        refused = [exc for exc in (_ended(call, 10) for call, _, _ in pushes) if exc is not None]
        assert [exc.code() for exc in refused] == [grpc.StatusCode.RESOURCE_EXHAUSTED], \
            f"two whole-lease pushes of one request were both taken: {refused}"
        assert "lease" in refused[0].details()
        held = next(call for call, _, _ in pushes if not call.done())
        cluster.state.release(d.config.worker_id, rid)  # the lease ends: the stalled push goes
        cut = _ended(held, 30)
        assert cut is not None, "a push outlived its lease, holding its buffer"

        dropped = f"dropped-{time.monotonic_ns()}"
        assert cluster.state.reserve(d.config.worker_id, d.epoch, dropped, 4, ttl_s=60).ok
        opened.append(_stalled_push(d, dropped, 1, tokens))
        call = opened[-1][0]
        assert _ended(call, 1) is None
        d.inbox.cancel(f"{dropped}#1")  # what the router's SessionCancel does for an attempt it gave up
        assert _ended(call, 10) is not None, "a push of a dropped attempt went on holding its buffer"
        cluster.state.release(d.config.worker_id, dropped)
    finally:
        for _, gone, ch in opened:
            gone.set()
            ch.close()
    deadline = time.monotonic() + 10
    while d.pushes.num_bytes:
        assert time.monotonic() < deadline, f"{d.pushes.num_bytes} bytes of pushes still counted"
        time.sleep(0.05)


def test_the_heartbeat_outlives_redis_refusing_commands_and_health_follows(cluster):
    """Redis out of memory (any refusal: READONLY, NOPERM alike) fails the heartbeat: once the entry has
    lapsed the worker says NOT_SERVING (routers cannot see it), stays alive for liveness, and
    re-registers and says SERVING by itself when Redis accepts writes again."""
    with EmbeddedRedis() as server:
        client, _ = connect(server.url)
        cfg = replace(cluster.worker_config, role="decode", worker_id="refused", kv_memory_gib=0.01)
        worker = DecodeWorker(cfg, StateStore(client), model=cluster.decode[0].model,
                              tokenizer=cluster.decode[0].tokenizer).start()
        try:
            assert worker.registration.registered.wait(10)
            assert health(worker.address) == health_pb2.HealthCheckResponse.SERVING
            client.config_set("maxmemory-policy", "noeviction")
            client.config_set("maxmemory", "1")
            deadline = time.monotonic() + 10
            while health(worker.address) != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline, "health stayed SERVING with the registration lapsed"
                time.sleep(0.1)
            assert health(worker.address, grpc_common.LIVENESS) == health_pb2.HealthCheckResponse.SERVING
            assert worker.registration._thread.is_alive(), "the heartbeat thread died on a refused command"
            client.config_set("maxmemory", "0")
            deadline = time.monotonic() + 10
            while health(worker.address) != health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline, "health never came back once Redis accepted writes"
                time.sleep(0.1)
            assert StateStore(client).get_worker("refused") is not None
        finally:
            client.config_set("maxmemory", "0")
            worker.stop(drain_timeout_s=1)
            client.close()


@pytest.mark.parametrize("rpc", ["Decode", "DecodeSession"])
def test_a_peers_kv_wait_is_bounded_by_the_workers_own(cluster, rpc):
    """A Decode (or a session's start) may ask for any KV wait; a peer asking for 10**9 s held its call, its
    in-flight guard and a drain behind it for as long. The worker's own kv_wait_s bounds it."""
    cfg = replace(cluster.worker_config, role="decode", worker_id=f"bounded-{rpc}", kv_wait_s=1.0, kv_memory_gib=0.01)
    worker = DecodeWorker(cfg, cluster.state, model=cluster.decode[0].model,
                          tokenizer=cluster.decode[0].tokenizer).start()
    rid = f"long-wait-{rpc}-{time.monotonic_ns()}"
    try:
        assert worker.registration.registered.wait(10)
        assert cluster.state.reserve(worker.config.worker_id, worker.epoch, rid, 2, ttl_s=60).ok
        request = internal_pb2.DecodeRequest(
            request_id=rid, epoch=worker.epoch, prompt_ids=PROMPT, output_ids=[7], attempt=1, kv_wait_s=1e9,
            sampling=sampling_to_pb(SamplingParams(temperature=0.0, max_tokens=3), 0))
        t0 = time.monotonic()
        with grpc.insecure_channel(worker.address) as ch:
            stub = internal_pb2_grpc.DecodeWorkerStub(ch)
            if rpc == "Decode":
                with pytest.raises(grpc.RpcError) as err:
                    list(stub.Decode(request, timeout=20))
                code, details = err.value.code(), err.value.details()
            else:
                stream = stub.DecodeSession(iter([internal_pb2.SessionRequest(start=request)]), timeout=20)
                try:
                    event = next(ev for msg in stream for ev in msg.events)
                    code = next(c for c in grpc.StatusCode if c.value[0] == event.status_code)
                    details = event.status_message
                except grpc.RpcError as exc:
                    code, details = exc.code(), exc.details()
        assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
        assert "did not arrive within 1.0 s" in details and time.monotonic() - t0 < 15
    finally:
        cluster.state.release(worker.config.worker_id, rid)
        worker.stop(drain_timeout_s=1)


# --------------------------------------------------------------------------- two workers on one host

def _spawn(module: str, redis_url: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    extra = ["--kv-memory-gib", "0.01"] if module == "decode_svc" else []
    return subprocess.Popen([sys.executable, "-m", module, "--redis-url", redis_url, "--host", "127.0.0.1",
                             "--advertise-host", "127.0.0.1", "--threads", "1", "--log-level", "WARNING",
                             *extra, *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_decode_workers_on_one_host_with_default_side_ports():
    """Only --port differs: the KV and metrics ports default to free ones, registered in Redis; a port
    in use is one line naming the flag to change, not a traceback."""
    with EmbeddedRedis() as server, socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        ports = []
        for _ in range(2):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                ports.append(s.getsockname()[1])
        procs = [_spawn("decode_svc", server.url, "--port", str(p), "--worker-id", f"d{i}")
                 for i, p in enumerate(ports)]
        clash = _spawn("prefill_svc", server.url, "--port", str(busy.getsockname()[1]))
        try:
            out, _ = clash.communicate(timeout=180)
            assert clash.returncode != 0
            assert "--port" in out and "Traceback" not in out, out[-2000:]
            store = StateStore(connect(server.url)[0])
            deadline = time.monotonic() + 180
            while len(store.list_workers("decode")) < 2:
                for p in procs:
                    assert p.poll() is None, p.communicate()[0][-3000:]
                assert time.monotonic() < deadline, "the two decode workers did not both register"
                time.sleep(0.5)
            workers = store.list_workers("decode")
            assert len({w.kv_address for w in workers}) == 2
            assert all(w.metrics_port for w in workers) and len({w.metrics_port for w in workers}) == 2
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()


def test_the_split_gives_the_tokens_of_the_engine_alone(cluster):
    """Invariant 4 in the default configuration: through router, prefill worker, KV push and decode
    worker, greedy and seeded requests give exactly what one colocated engine gives."""
    import torch
    from common.engine.engine import Engine, EngineConfig
    from common.engine.kv_cache import KVCache
    from common.engine.runner import ModelRunner
    from protos import handoff_pb2, handoff_pb2_grpc

    d = cluster.decode[0]
    runner = ModelRunner(d.model, KVCache(d.model.config, 64, 16, d.model.dtype), packed_decode=True)
    requests = {"greedy": dict(temperature=0.0), "seeded": dict(temperature=1.0, top_p=0.9, seed=77)}
    with grpc.insecure_channel(cluster.address) as ch:
        stub = handoff_pb2_grpc.RouterStub(ch)
        for kind, sampling in requests.items():
            prompt = "Write one sentence about the sea."
            msgs = list(stub.Generate(handoff_pb2.GenerateRequest(prompt=prompt, max_tokens=24, ignore_eos=True,
                                                                  **sampling), timeout=120))
            ids = [t for m in msgs for t in m.token_ids]
            engine = Engine(runner, d.tokenizer, EngineConfig())
            events = []
            engine.submit("alone", d.tokenizer.encode(prompt),
                          SamplingParams(max_tokens=24, ignore_eos=True, **sampling), events.append,
                          seed=msgs[-1].seed)
            while not events or events[-1].finish_reason is None:
                engine.step()
            assert ids == [t for e in events for t in e.token_ids], kind
    assert d.model.has_packed and d.model.dtype in (torch.float32, torch.bfloat16)


def test_a_shared_prefix_is_neither_recomputed_nor_pushed_again(cluster):
    """The second request with the same long prompt: the prefill worker reuses its cached chunks, the
    push leaves out the blocks the decode worker already holds, and the tokens are those of the first."""
    from protos import handoff_pb2, handoff_pb2_grpc

    words = "The library opens at nine and closes at six; children's books are on the ground floor. "
    prompt = words * 40
    d = cluster.decode[0]
    chunk = d.engine.hasher.chunk_tokens
    outs = []
    with grpc.insecure_channel(cluster.address) as ch:
        stub = handoff_pb2_grpc.RouterStub(ch)
        for i in range(2):
            rid = f"prefix-{i}-{time.monotonic_ns()}"
            msgs = list(stub.Generate(handoff_pb2.GenerateRequest(prompt=prompt, max_tokens=6, temperature=0.0,
                                                                  ignore_eos=True, request_id=rid), timeout=120))
            outs.append(([t for m in msgs for t in m.token_ids], msgs[-1].prompt_tokens,
                         cluster.state.get_request(rid)))
    (first_ids, n, first), (second_ids, _, second) = outs
    reusable = (n - 1) // chunk * chunk
    assert n > 2 * chunk and reusable >= 2 * chunk
    assert int(first["cached_tokens"]) == 0 and int(first["skipped_tokens"]) == 0
    assert int(second["cached_tokens"]) == reusable
    assert int(second["skipped_tokens"]) == reusable
    assert int(second["kv_bytes"]) == d.fingerprint().kv_bytes(n - reusable)
    assert second_ids == first_ids


def test_a_session_cancel_drops_kv_of_an_attempt_that_never_decodes(cluster):
    """The router cancels, on its decode session, an attempt that ended between its first token and its
    decode (client gone, a failure): KV pushed already is dropped at once, KV pushed later is refused."""
    import queue

    d = cluster.decode[0]
    early, late = f"early-{time.monotonic_ns()}", f"late-{time.monotonic_ns()}"
    requests: queue.SimpleQueue = queue.SimpleQueue()
    ch = grpc.insecure_channel(d.address)
    stream = internal_pb2_grpc.DecodeWorkerStub(ch).DecodeSession(iter(requests.get, None), timeout=60)
    try:
        prefill(cluster, early)
        wait_parked(d, 1)
        for rid in (early, late):
            requests.put(internal_pb2.SessionRequest(cancel=internal_pb2.SessionCancel(request_id=rid, attempt=1)))
        wait_parked(d, 0)  # long before the KV wait (30 s) would have dropped it
        deadline = time.monotonic() + 10
        while f"{late}#1" not in d.inbox._cancelled:  # the cancel is read on the session's own thread
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as err:
            prefill(cluster, late)
        assert err.value.code() == grpc.StatusCode.CANCELLED
        assert d.engine.num_parked == 0
    finally:
        requests.put(None)
        stream.cancel()
        ch.close()
        release_all(cluster)
