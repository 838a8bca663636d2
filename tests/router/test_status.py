"""python -m router.status and its drain, against a real Redis, a worker process and an in-process cluster."""
from __future__ import annotations

import contextlib
import io
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from common.redis_server import EmbeddedRedis, connect
from common.state import RequestState, StateStore, WorkerInfo
from protos import handoff_pb2, handoff_pb2_grpc
from router import status
from router.cluster import Cluster
from router.config import RouterConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_password_in_env(monkeypatch):
    monkeypatch.delenv("REDIS_PASSWORD", raising=False)
    monkeypatch.delenv("REDIS_USERNAME", raising=False)


def run_status(url: str, *args: str) -> tuple[int, str, str]:
    """status.main in this process (the real code against the real server); (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = status.main(["--redis-url", url, *args])
        except SystemExit as exc:  # argparse
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def status_process(*args: str, **popen) -> subprocess.Popen:
    """router.status as a terminal runs it: SIGINT at its default, so that Python turns it into
    KeyboardInterrupt (Ctrl-C), even where this test run inherited it ignored (a script's background job)."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "REDIS_PASSWORD")}
    return subprocess.Popen([sys.executable, "-m", "router.status", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **popen)


# --- against a Redis holding registered workers and records ------------------------------------

@pytest.fixture(scope="module")
def server():
    with EmbeddedRedis() as srv:
        yield srv


@pytest.fixture
def store(server):
    client, _ = connect(server.url)
    client.flushdb()  # the tool reads the default prefix, as the services write it
    yield StateStore(client)
    client.close()


def worker(worker_id: str, role: str, epoch: str = "epoch-1", total_blocks: int = 40, **fields) -> WorkerInfo:
    values = dict(worker_id=worker_id, role=role, address="10.0.0.7:50071", kv_address="10.0.0.7:50072",
                  epoch=epoch, model_id="m", total_blocks=total_blocks, free_blocks=total_blocks, num_running=0,
                  num_waiting=0, started_at=time.time() - 125)
    return WorkerInfo(**{**values, **fields})


def finished_request(store: StateStore, rid: str, *, prompt_tokens=10, completion_tokens=5) -> None:
    store.create_request(rid, prompt_tokens=prompt_tokens, max_tokens=16, seed="7")
    store.transition(rid, RequestState.PREFILLING, prefill_worker="p0", decode_worker="d0")
    store.transition(rid, RequestState.TRANSFERRING)
    store.transition(rid, RequestState.DECODING, kv_bytes=4096, transfer_s=0.002)
    store.transition(rid, RequestState.FINISHED, completion_tokens=completion_tokens, finish_reason="stop")


def test_overview_shows_workers_leases_and_the_newest_requests(store, server):
    store.register(worker("d0", "decode", free_blocks=30, num_running=2, num_waiting=1), ttl_s=30)
    store.register(worker("p0", "prefill", kv_address="", total_blocks=64), ttl_s=30)
    assert store.reserve("d0", "epoch-1", "r-live", 6, ttl_s=30).ok
    assert store.reserve("d0", "epoch-1", "r-other", 2, ttl_s=30).ok
    for rid in ("r-old", "r-mid"):
        finished_request(store, rid)
        time.sleep(0.01)
    store.create_request("r-live", prompt_tokens=3, max_tokens=4)
    store.transition("r-failed-never", RequestState.FAILED)  # unknown id: no record is created

    code, out, err = run_status(server.url, "--json")
    assert code == 0, err
    snap = json.loads(out)
    workers = {w["worker_id"]: w for w in snap["workers"]}
    assert [w["role"] for w in snap["workers"]] == ["prefill", "decode"]
    d0 = workers["d0"]
    assert (d0["epoch"], d0["total_blocks"], d0["free_blocks"], d0["available_blocks"]) == ("epoch-1", 40, 30, 32)
    assert (d0["num_leases"], d0["leased_blocks"], d0["num_running"], d0["num_waiting"]) == (2, 8, 2, 1)
    assert 120 < d0["up_s"] < 200 and not d0["draining"]
    assert workers["p0"]["total_blocks"] == 64 and "num_leases" not in workers["p0"]
    assert [r["request_id"] for r in snap["requests"]] == ["r-live", "r-mid", "r-old"]  # newest first
    live, mid = snap["requests"][0], snap["requests"][1]
    assert (live["state"], live["ttft_s"], live["e2e_s"]) == ("queued", None, None)
    assert (mid["state"], mid["prefill_worker"], mid["decode_worker"]) == ("finished", "p0", "d0")
    assert (mid["prompt_tokens"], mid["completion_tokens"], mid["kv_bytes"]) == (10, 5, 4096)
    assert 0 <= mid["ttft_s"] <= mid["e2e_s"] < 1
    assert snap["num_records"] == 3

    code, out, _ = run_status(server.url, "--limit", "2")
    assert code == 0
    assert "recent requests: 2 newest of 3 records" in out
    assert "r-old" not in out and "r-live" in out and "r-mid" in out
    d0_row = next(line for line in out.splitlines() if line.startswith("d0 "))
    assert d0_row.split()[:9] == ["d0", "epoch-1", "2m05s", "30/40", "32", "2", "(8)", "2", "1"]


def test_request_shows_one_record_with_its_history(store, server):
    finished_request(store, "r-1", prompt_tokens=12, completion_tokens=4)
    code, out, err = run_status(server.url, "request", "r-1")
    assert code == 0, err
    assert out.startswith("request r-1: finished (stop)")
    assert "tokens: prompt 12, completion 4 of max 16" in out
    assert "workers: prefill p0, decode d0" in out and "seed: 7" in out
    states = [line.split()[0] for line in out.split("history:")[1].strip().splitlines()]
    assert states == ["queued", "prefilling", "transferring", "decoding", "finished"]

    code, out, _ = run_status(server.url, "request", "r-1", "--json")
    record = json.loads(out)
    assert record["request_id"] == "r-1" and record["completion_tokens"] == 4
    stamps = [ts for _, ts in record["history"]]
    assert stamps == sorted(stamps) and record["ttft_s"] == pytest.approx(stamps[2] - stamps[0])


def test_unknown_ids_get_a_clear_message(store, server):
    store.register(worker("d0", "decode"), ttl_s=30)
    code, out, err = run_status(server.url, "request", "no-such-request")
    assert code == 1 and out == ""
    assert "no record of request 'no-such-request'" in err and "expired" in err
    code, _, err = run_status(server.url, "drain", "d9")
    assert code == 1 and "no worker 'd9' in the registry (live workers: d0)" in err
    assert store.drain_requests() == {}
    code, _, err = run_status(server.url, "drain")
    assert code == 2 and "drain needs an id" in err


def test_drain_of_a_worker_that_never_acts_times_out_and_is_withdrawn(store, server):
    store.register(worker("d0", "decode"), ttl_s=30)  # an entry with no process behind it
    t0 = time.monotonic()
    code, out, err = run_status(server.url, "drain", "d0", "--timeout-s", "0.5")
    assert code == 1 and time.monotonic() - t0 < 5
    assert "drain requested" in out
    assert "did not act on the drain request" in err and "withdrawn" in err
    assert store.drain_requests() == {} and store.get_worker("d0") is not None


def test_unreachable_redis_is_one_line_and_a_nonzero_exit():
    with EmbeddedRedis() as srv:
        url = srv.url
    proc = status_process("--redis-url", url)  # the server has gone: nothing listens there
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert "is unreachable" in err and "REDIS_URL" in err and "REDIS_PASSWORD" in err

    proc = status_process()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "set --redis-url or REDIS_URL" in err


def read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"no output within {timeout_s} s"
    return proc.stdout.readline()


def test_watch_refreshes_until_interrupted(store, server):
    proc = status_process("--redis-url", server.url, "--watch", "0.2", "--json")
    try:
        first = json.loads(read_line(proc, 30))
        assert first["workers"] == []
        store.register(worker("d0", "decode"), ttl_s=30)
        deadline = time.monotonic() + 10
        while not json.loads(read_line(proc, 5))["workers"]:
            assert time.monotonic() < deadline, "a new worker never appeared in the refreshed view"
        server.stop()  # Redis goes away: the view says so and keeps watching
        try:
            deadline = time.monotonic() + 15
            while "error" not in (view := json.loads(read_line(proc, 10))):
                assert time.monotonic() < deadline, "the outage never showed"
            assert "is unreachable" in view["error"]
        finally:
            server.start()  # the same port, empty
        deadline = time.monotonic() + 15
        while "error" in (view := json.loads(read_line(proc, 10))):
            assert time.monotonic() < deadline, "the view did not recover after Redis came back"
        assert view["workers"] == []
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
        assert proc.returncode == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ttft_comes_from_the_first_token_of_the_first_attempt():
    q = RequestState
    retried = {"history": [(q.QUEUED, 100.0), (q.PREFILLING, 100.1), (q.TRANSFERRING, 100.3), (q.DECODING, 100.4),
                           (q.PREFILLING, 101.0), (q.TRANSFERRING, 101.2), (q.FINISHED, 102.0)],
               "completion_tokens": 9}
    assert status.ttft_s(retried) == pytest.approx(0.3)
    one_token = {"history": [(q.QUEUED, 100.0), (q.PREFILLING, 100.1), (q.FINISHED, 100.25)], "completion_tokens": 1}
    assert status.ttft_s(one_token) == pytest.approx(0.25)
    no_token = {"history": [(q.QUEUED, 100.0), (q.PREFILLING, 100.1), (q.FAILED, 100.2)], "completion_tokens": 0}
    assert status.ttft_s(no_token) is None
    assert status.ttft_s({"history": [(q.QUEUED, 100.0), (q.PREFILLING, 100.1)]}) is None


def test_state_drain_requests_are_per_epoch_and_expire(store):
    store.request_drain("d0", "epoch-1", ttl_s=30)
    assert store.drain_requested("d0", "epoch-1")
    assert not store.drain_requested("d0", "epoch-2")  # the same id restarted: not for it
    assert not store.end_drain("d0", "epoch-2")
    assert set(store.drain_requests()) == {"d0"}
    assert store.end_drain("d0", "epoch-1") and store.drain_requests() == {}
    store.request_drain("d1", "e", ttl_s=0.2)
    time.sleep(0.3)
    assert store.drain_requests() == {} and not store.drain_requested("d1", "e")


def test_state_recent_request_ids_stay_within_their_prefix_and_caps(store):
    other = StateStore(store.client, prefix="other[1]*:")  # glob characters in a prefix are literal
    for i in range(5):
        store.create_request(f"r{i}", prompt_tokens=1, max_tokens=1)
        time.sleep(0.002)
    other.create_request("x", prompt_tokens=1, max_tokens=1)
    ids, num_seen = store.recent_request_ids(limit=3)
    assert ids == ["r4", "r3", "r2"] and num_seen == 5
    assert other.recent_request_ids(limit=10) == (["x"], 1)
    ids, num_seen = store.recent_request_ids(limit=10, max_scanned=2)
    assert len(ids) == 2 and num_seen == 2


# --- drain of a real worker process: it leaves the registry and exits 0 --------------------------

def test_drain_makes_a_worker_process_finish_leave_and_exit_0(tmp_path):
    with EmbeddedRedis() as srv:
        client, _ = connect(srv.url)
        state = StateStore(client)
        log_path = tmp_path / "prefill.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        with open(log_path, "wb") as log:
            worker_proc = subprocess.Popen(
                [sys.executable, "-m", "prefill_svc", "--host", "127.0.0.1", "--port", "0", "--redis-url", srv.url,
                 "--metrics-port", "0", "--advertise-host", "127.0.0.1", "--worker-id", "prefill-proc",
                 "--threads", "1"],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 180
            while state.get_worker("prefill-proc") is None:
                assert worker_proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, f"the worker did not register:\n{log_path.read_text()}"
                time.sleep(0.2)
            drain_proc = status_process("drain", "prefill-proc", "--redis-url", srv.url, "--timeout-s", "60")
            out, err = drain_proc.communicate(timeout=90)
            assert drain_proc.returncode == 0, out + err
            assert "drain requested" in out and "left the registry after" in out and "drained in" in out
            assert worker_proc.wait(timeout=30) == 0, log_path.read_text()
            assert "drain requested: draining" in log_path.read_text()
            assert state.get_worker("prefill-proc") is None and state.drain_requests() == {}
        finally:
            if worker_proc.poll() is None:
                os.killpg(worker_proc.pid, signal.SIGKILL)
                worker_proc.wait()
            client.close()


# --- an in-process cluster: real requests in the view; drain with a request in flight ----------------

@pytest.fixture(scope="module")
def cluster():
    c = Cluster(num_prefill=1, num_decode=1, dtype="fp32", kv_memory_gib=0.05, threads=1,
                router=RouterConfig(queue_timeout_s=1.0)).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def stub(cluster):
    ch = grpc.insecure_channel(cluster.address)
    yield handoff_pb2_grpc.RouterStub(ch)
    ch.close()


def generate(stub, **fields) -> list[handoff_pb2.GenerateResponse]:
    return list(stub.Generate(handoff_pb2.GenerateRequest(temperature=0.0, ignore_eos=True, **fields), timeout=120))


def test_the_view_shows_what_the_cluster_served(cluster, stub):
    msgs = generate(stub, prompt="The capital of France is", max_tokens=6, request_id="status-seen")
    code, out, err = run_status(cluster.redis.url, "--json")
    assert code == 0, err
    snap = json.loads(out)
    record = next(r for r in snap["requests"] if r["request_id"] == "status-seen")
    last = msgs[-1]
    assert (record["state"], record["finish_reason"]) == ("finished", "length")
    assert (record["prefill_worker"], record["decode_worker"]) == ("prefill-0", "decode-0")
    assert (record["prompt_tokens"], record["completion_tokens"]) == (last.prompt_tokens, last.completion_tokens)
    # The router measures from arrival, the record from its creation: a few ms apart at most.
    assert record["ttft_s"] == pytest.approx(last.ttft_s, abs=0.05)
    assert record["e2e_s"] >= record["ttft_s"]
    assert {w["worker_id"]: w["role"] for w in snap["workers"]} == {"prefill-0": "prefill", "decode-0": "decode"}
    code, out, _ = run_status(cluster.redis.url, "request", "status-seen")
    assert code == 0 and "workers: prefill prefill-0, decode decode-0" in out


def test_drain_finishes_the_request_in_flight_then_new_requests_go_elsewhere(cluster, stub):
    state = cluster.state
    max_tokens = 64
    result: dict = {}

    def long_request():
        try:
            result["msgs"] = generate(stub, prompt="Once upon a time", max_tokens=max_tokens, request_id="in-flight")
        except grpc.RpcError as exc:
            result["error"] = exc

    client = threading.Thread(target=long_request)
    client.start()
    deadline = time.monotonic() + 60
    while (state.get_request("in-flight") or {}).get("state") != RequestState.DECODING:
        assert time.monotonic() < deadline and client.is_alive(), f"never decoding: {result}"
        time.sleep(0.02)

    code, out, err = run_status(cluster.redis.url, "drain", "decode-0", "--timeout-s", "60")
    assert code == 0, out + err
    assert "decode-0 left the registry after" in out and "decode-0 drained in" in out
    client.join(timeout=60)
    # The drain waited for the request: it ran to its end, every token, no error.
    assert "error" not in result, result
    assert result["msgs"][-1].finish_reason == handoff_pb2.FINISH_REASON_LENGTH
    assert sum(len(m.token_ids) for m in result["msgs"]) == max_tokens
    record = state.get_request("in-flight")
    assert (record["state"], record["decode_worker"]) == (RequestState.FINISHED, "decode-0")
    drained = cluster.decode[0]
    assert drained.draining.is_set() and drained.engine.num_active == 0
    assert drained.engine.pool.num_free_blocks == drained.engine.pool.num_blocks
    assert state.get_worker("decode-0") is None and state.drain_requests() == {}

    # No decode worker left: a clear status, not a hang.
    with pytest.raises(grpc.RpcError) as exc_info:
        generate(stub, prompt="Hello", max_tokens=2)
    assert exc_info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no decode worker is registered" in exc_info.value.details()

    # A new decode worker takes the next request.
    from decode_svc.worker import DecodeWorker
    cfg = replace(cluster.worker_config, role="decode", worker_id="decode-1")
    fresh = DecodeWorker(cfg, state, model=drained.model, tokenizer=drained.tokenizer).start()
    cluster.decode.append(fresh)
    assert fresh.registration.registered.wait(10)
    generate(stub, prompt="Hello", max_tokens=2, request_id="after-drain")
    assert state.get_request("after-drain")["decode_worker"] == "decode-1"
    code, _, err = run_status(cluster.redis.url, "drain", "decode-0")
    assert code == 1 and "no worker 'decode-0' in the registry (live workers: decode-1, prefill-0)" in err
