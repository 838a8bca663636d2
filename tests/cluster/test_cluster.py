"""Integration tests against a real in-process cluster: embedded Redis, real gRPC, real model."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.engine.engine import Engine, EngineConfig
from common.engine.kv_cache import KVCache
from common.kv_wire import encode_kv
from common.redis_server import EmbeddedRedis, connect
from common.engine.runner import ModelRunner
from common.engine.sampling import SamplingParams
from common.state import RequestState, StateStore
from decode_svc.worker import DecodeWorker
from protos import handoff_pb2, handoff_pb2_grpc, internal_pb2_grpc
from common.worker import WorkerConfig
from router.cluster import Cluster
from tests.support.cluster import wait_idle

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "Paris is the capital of",
]


@pytest.fixture(scope="module")
def cluster():
    # fp32 with dense decode: the configuration whose greedy output must equal HF's token for token.
    # (The default configuration is proven against the engine alone in test_worker_contract.py.)
    c = Cluster(num_prefill=1, num_decode=2, dtype="fp32", kv_memory_gib=0.25, threads=1,
                worker=WorkerConfig(role="prefill", packed_decode=False)).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def stub(cluster):
    ch = grpc.insecure_channel(cluster.address)
    yield handoff_pb2_grpc.RouterStub(ch)
    ch.close()


def generate(stub, timeout=120, **fields):
    msgs = list(stub.Generate(handoff_pb2.GenerateRequest(**fields), timeout=timeout))
    return msgs, [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs)


def engine_alone_greedy(cluster, prompt_ids, max_tokens):
    runner = ModelRunner(cluster.decode[0].model, KVCache(cluster.decode[0].model.config, 64, 16,
                                                          torch.float32), packed_decode=False)
    engine = Engine(runner, cluster.decode[0].tokenizer, EngineConfig())
    events = []
    engine.submit("solo", prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                  events.append, seed=0)
    while not events or events[-1].finish_reason is None:
        engine.step()
    return [t for e in events for t in e.token_ids]


def test_greedy_through_cluster_equals_engine_and_hf(cluster, stub, hf_smollm2):
    tok = cluster.decode[0].tokenizer
    for prompt in PROMPTS:
        msgs, ids, text = generate(stub, prompt=prompt, max_tokens=16, temperature=0.0, ignore_eos=True)
        assert msgs[-1].finish_reason == handoff_pb2.FINISH_REASON_LENGTH
        assert msgs[-1].completion_tokens == 16 and len(ids) == 16
        assert text == tok.decode(ids, skip_special=True)
        prompt_ids = tok.encode(prompt)
        assert ids == engine_alone_greedy(cluster, prompt_ids, 16), prompt
        with torch.no_grad():
            ref = hf_smollm2.generate(torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False,
                                       min_new_tokens=16)
        assert ids == ref[0, len(prompt_ids):].tolist(), prompt
    wait_idle(cluster)


def test_logprobs_through_the_cluster_equal_hf(cluster, stub, hf_smollm2):
    """Generate with logprobs: the first token's (from the prefill worker) and every decode token's
    logprob and top 5 are HF's fp32 log-softmax within 1e-4, one entry per token id; a request that
    ends at EOS lists no entry for it; nothing comes back unasked."""
    tok = cluster.decode[0].tokenizer
    prompt = "The quick brown fox"
    msgs, ids, _ = generate(stub, prompt=prompt, max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True,
                            top_logprobs=5)
    lps = [lp for m in msgs for lp in m.logprobs]
    assert [lp.token_id for lp in lps] == ids and len(ids) == 8
    prompt_ids = tok.encode(prompt)
    with torch.no_grad():
        logits = hf_smollm2(torch.tensor([prompt_ids + ids[:-1]])).logits[0, len(prompt_ids) - 1:].float()
    ref = torch.log_softmax(logits, dim=-1)
    for pos, lp in enumerate(lps):
        assert abs(lp.logprob - ref[pos, lp.token_id].item()) < 1e-4, pos
        top = [(t.token_id, t.logprob) for t in lp.top_logprobs]
        assert len(top) == 5 and top[0][0] == lp.token_id, "greedy takes the most likely token"
        for token_id, value in top:
            assert abs(value - ref[pos, token_id].item()) < 1e-4, (pos, token_id)
        assert top[-1][1] >= ref[pos].topk(5).values[-1].item() - 1e-4, "the 5 most likely, as HF ranks them"
    msgs, ids, _ = generate(stub, messages=[handoff_pb2.ChatMessage(role="user", content="What is 2 + 2?")],
                            max_tokens=64, temperature=0.0, logprobs=True)
    assert msgs[-1].finish_reason == handoff_pb2.FINISH_REASON_STOP and len(ids) < msgs[-1].completion_tokens
    assert [lp.token_id for m in msgs for lp in m.logprobs] == ids
    assert all(not lp.top_logprobs for m in msgs for lp in m.logprobs)
    assert not any(m.logprobs for m in generate(stub, prompt=prompt, max_tokens=3, temperature=0.0)[0])
    wait_idle(cluster)


def test_twenty_concurrent_mixed_requests(cluster, stub):
    def request(i):
        kind = i % 4
        fields = dict(prompt=f"Story number {i}: once upon a time", max_tokens=4 + (i % 5) * 3, ignore_eos=True)
        if kind == 0:
            fields.update(temperature=0.0)
        elif kind == 1:
            fields.update(temperature=0.9, top_p=0.9, seed=1000 + i)
        elif kind == 2:
            fields.update(temperature=0.7, top_k=20, repetition_penalty=1.2, seed=2000 + i)
        else:
            fields.update(temperature=1.0, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3, seed=3000 + i)
        fields["request_id"] = f"mixed-{i}-{time.monotonic_ns()}"
        msgs, ids, _ = generate(stub, **fields)
        return fields, msgs, ids

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(request, range(20)))
    decode_workers = set()
    for fields, msgs, ids in results:
        assert msgs[-1].finish_reason == handoff_pb2.FINISH_REASON_LENGTH
        assert len(ids) == fields["max_tokens"]
        record = cluster.state.get_request(fields["request_id"])
        assert record["state"] == RequestState.FINISHED
        decode_workers.add(record["decode_worker"])
    assert decode_workers == {"decode-0", "decode-1"}, "both decode workers should have served requests"
    # Seeded (and greedy) ones reproduce exactly, run again one at a time.
    for fields, _, ids in results[:8]:
        again = dict(fields, request_id=fields["request_id"] + "-again")
        assert generate(stub, **again)[1] == ids, fields
    wait_idle(cluster)


def test_client_cancel_frees_kv_and_lease(cluster, stub):
    # Many times: a cancel that lands as a token arrives was once dropped (about one in ten), and the
    # request then decoded to the end for nobody.
    for attempt in range(12):
        rid = f"cancel-{attempt}-{time.monotonic_ns()}"
        call = stub.Generate(handoff_pb2.GenerateRequest(prompt="Count to one thousand:", max_tokens=400,
                                                         temperature=0.0, ignore_eos=True, request_id=rid),
                             timeout=120)
        got = 0
        for msg in call:
            got += len(msg.token_ids)
            if got >= 5:
                call.cancel()
                break
        deadline = time.monotonic() + 10
        while (record := cluster.state.get_request(rid))["state"] != RequestState.CANCELLED:
            assert time.monotonic() < deadline, f"attempt {attempt}: record stayed {record['state']}"
            time.sleep(0.05)
        assert int(record["completion_tokens"]) < 400
        wait_idle(cluster)


@pytest.mark.parametrize("fields, names", [
    (dict(), "prompt or messages"),
    (dict(prompt="hi", messages=[handoff_pb2.ChatMessage(role="user", content="x")]), "either prompt or messages"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", max_tokens=10**6), "max_tokens"),
    (dict(prompt="hi", temperature=-1.0), "temperature"),
    (dict(prompt="hi", temperature=float("nan")), "temperature"),
    (dict(prompt="hi", top_p=0.0), "top_p"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(prompt="hi", top_k=-1), "top_k"),
    (dict(prompt="hi", min_p=2.0), "min_p"),
    (dict(prompt="hi", repetition_penalty=0.0), "repetition_penalty"),
    (dict(prompt="hi", presence_penalty=3.0), "presence_penalty"),
    (dict(prompt="hi", frequency_penalty=-3.0), "frequency_penalty"),
    (dict(prompt="hi", stop=["x"] * 17), "stop"),
    (dict(prompt="hi", stop=[""]), "stop"),
    (dict(prompt="hi", stop_token_ids=[10**7]), "stop_token_ids"),
    (dict(prompt="hi", seed=2**63), "seed"),
    (dict(prompt="hi", request_id="bad id with spaces"), "request_id"),
    (dict(messages=[handoff_pb2.ChatMessage(role="robot", content="x")]), "role"),
    (dict(prompt="word " * 9000), "context"),
    (dict(prompt="hi", top_logprobs=3), "top_logprobs needs logprobs"),
    (dict(prompt="hi", logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(prompt="hi", prompt_token_ids=[1, 2]), "prompt_token_ids"),
    (dict(prompt_token_ids=[10**7]), "prompt_token_ids"),
])
def test_bad_fields_are_invalid_argument(cluster, stub, fields, names):
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, timeout=30, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert names in err.value.details()
    # ...and the cluster keeps serving.
    assert generate(stub, prompt="hello", max_tokens=2, temperature=0.0)[0][-1].finish_reason


def test_duplicate_request_id_is_already_exists(cluster, stub):
    rid = f"dup-{time.monotonic_ns()}"
    generate(stub, prompt="hello", max_tokens=2, request_id=rid)
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, prompt="hello", max_tokens=2, request_id=rid)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS


def test_record_shows_states_in_order(cluster, stub):
    rid = f"record-{time.monotonic_ns()}"
    msgs, ids, _ = generate(stub, prompt="Hello there", max_tokens=5, temperature=0.0, ignore_eos=True,
                            request_id=rid)
    record = cluster.state.get_request(rid)
    states = [s for s, _ in record["history"]]
    assert states == [RequestState.QUEUED, RequestState.PREFILLING, RequestState.TRANSFERRING,
                      RequestState.DECODING, RequestState.FINISHED]
    stamps = [t for _, t in record["history"]]
    assert stamps == sorted(stamps) and stamps[-1] - stamps[0] < 60
    assert record["prefill_worker"] == "prefill-0" and record["decode_worker"] in ("decode-0", "decode-1")
    assert record["completion_tokens"] == 5
    fp = cluster.decode[0].fingerprint()
    assert int(record["kv_bytes"]) == fp.kv_bytes(msgs[-1].prompt_tokens)


def _push(worker: DecodeWorker, *, fingerprint=None, epoch=None, worker_id=None, num_tokens=4, reserve=True):
    """A push of zeros, under a fresh reservation of the worker's blocks unless reserve=False."""
    fp = fingerprint or worker.fingerprint()
    kv = torch.zeros(fp.num_layers, 2, num_tokens, fp.num_kv_heads, fp.head_dim, dtype=fp.torch_dtype)
    rid = f"push-{time.monotonic_ns()}"
    if reserve:
        assert worker.state.reserve(worker.config.worker_id, worker.epoch, rid, 1, ttl_s=5).ok
    ch = grpc.insecure_channel(worker.kv_address)
    try:
        return internal_pb2_grpc.KVTransferStub(ch).PushKV(
            encode_kv(kv, request_id=rid, target_worker_id=worker_id or worker.config.worker_id,
                      target_epoch=epoch or worker.epoch, fingerprint=fp), timeout=10)
    finally:
        ch.close()
        worker.state.release(worker.config.worker_id, rid)


def test_kv_push_with_wrong_fingerprint_or_epoch_is_rejected(cluster):
    w = cluster.decode[0]
    assert _push(w).num_tokens == 4  # the right one is accepted (and expires unclaimed)
    for bad in (dict(fingerprint=replace(w.fingerprint(), weights_id="another-model")),
                dict(fingerprint=replace(w.fingerprint(), block_size=32)),
                dict(fingerprint=replace(w.fingerprint(), dtype="bfloat16")),
                dict(epoch="an-old-epoch"),
                dict(worker_id="decode-1")):
        with pytest.raises(grpc.RpcError) as err:
            _push(w, **bad)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, bad
        assert "rejected" in err.value.details()
    w.inbox.sweep()


def test_kv_push_without_a_reservation_is_refused_before_its_buffer(cluster):
    """Redis may have promised unleased blocks to someone else: the decode worker takes no KV for a
    request that holds no live lease on it (nor one too small for the push)."""
    w = cluster.decode[0]
    used = w.engine.pool.num_used_blocks
    with pytest.raises(grpc.RpcError) as err:
        _push(w, reserve=False)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no live reservation" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        _push(w, num_tokens=40)  # 3 blocks of 16, the lease holds 1
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "reserved 1 KV blocks" in err.value.details()
    assert w.engine.pool.num_used_blocks == used


def test_health_is_serving_only_once_registered(cluster):
    redis_server = EmbeddedRedis().start()
    client, _ = connect(redis_server.url)
    url_port = redis_server.port
    redis_server.stop()  # the worker starts while Redis is down: it cannot register
    cfg = replace(cluster.worker_config, role="decode", worker_id="health-probe", kv_memory_gib=0.01)
    worker = DecodeWorker(cfg, StateStore(client), model=cluster.decode[0].model,
                          tokenizer=cluster.decode[0].tokenizer).start()
    ch = grpc.insecure_channel(f"127.0.0.1:{worker.config.port}")
    health = health_pb2_grpc.HealthStub(ch)
    try:
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        restarted = EmbeddedRedis(port=url_port).start()
        try:
            deadline = time.monotonic() + 10
            while health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status \
                    != health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline, "worker never became SERVING after Redis came up"
                time.sleep(0.1)
            assert cluster.state.get_worker("health-probe") is None  # registered in the other Redis only
        finally:
            restarted.stop()
    finally:
        worker.stop(drain_timeout_s=1)
        ch.close()
