"""The OpenAI-compatible HTTP API, driven by the official `openai` client (unmodified, base_url=) against a
real in-process cluster in the default configuration: chat and completions, streaming and not, logprobs,
n choices, greedy output equal to the gRPC path's, an error of each kind with its status, and clients
that leave mid-request (their KV freed, their record `cancelled`)."""
from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import grpc
import openai
import pytest
from prometheus_client import REGISTRY, generate_latest

from common.engine.sampling import MAX_SEED
from common.redis_server import EmbeddedRedis, connect
from common.state import RequestState, StateStore
from protos import handoff_pb2, handoff_pb2_grpc
from router import openai_schema
from router.cluster import Cluster
from tests.support.cluster import wait_idle
from router.config import RouterConfig
from router.server import RouterServer

KEY = "test-key-0123"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def cluster():
    # 0.075 GiB of KV: 1,747 tokens in fp32 (what AVX2 hosts serve), 3,495 in bf16; the timeout test
    # reserves 1,504, the admission test asks for more than 4,000.
    c = Cluster(num_prefill=1, num_decode=1, kv_memory_gib=0.075, threads=1,
                router=RouterConfig(api_keys=(KEY,), max_body_bytes=1 << 16)).start()
    yield c
    c.stop(drain_timeout_s=2)


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=cluster.http_url, api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def stub(cluster):
    ch = grpc.insecure_channel(cluster.address)
    yield handoff_pb2_grpc.RouterStub(ch)
    ch.close()


def grpc_generate(stub, **fields) -> list[handoff_pb2.GenerateResponse]:
    return list(stub.Generate(handoff_pb2.GenerateRequest(**fields), timeout=120,
                              metadata=[("authorization", f"Bearer {KEY}")]))


def ids_of(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def wait_state(cluster, request_id: str, state: RequestState, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        record = cluster.state.get_request(request_id)
        if record is not None and record["state"] == state:
            return record
        assert time.monotonic() < deadline, f"{request_id}: record {record and record['state']}, not {state}"
        time.sleep(0.05)


@dataclass
class Raw:
    status_code: int
    headers: dict[str, str]
    text: str

    def json(self):
        return json.loads(self.text)


def raw(cluster, method: str, path: str, *, content: bytes | None = None, json_body=None,
        headers: dict[str, str] | None = None) -> Raw:
    """A plain HTTP request (no openai client), with the API key unless headers say otherwise."""
    url = cluster.http_url.removesuffix("/v1") + path
    data = json.dumps(json_body).encode() if json_body is not None else content
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Authorization": f"Bearer {KEY}", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return Raw(resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read().decode())
    except urllib.error.HTTPError as err:
        return Raw(err.code, {k.lower(): v for k, v in err.headers.items()}, err.read().decode())


# --------------------------------------------------------------------------- answers


def test_models_health_and_metrics(cluster, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["smollm2"] and models[0].owned_by == "handoff"
    health = raw(cluster, "GET", "/health", headers={"Authorization": ""})
    assert health.status_code == 200, "health needs no key (probes carry none)"
    client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2)
    assert raw(cluster, "GET", "/metrics", headers={"Authorization": ""}).status_code == 404, \
        "metrics are on --metrics-port, never on the public port"
    body = generate_latest(REGISTRY).decode()
    assert 'handoff_router_http_responses_total{route="/v1/completions",status="200"}' in body
    assert "handoff_router_ttft_seconds_count" in body and "handoff_router_requests_total" in body


def test_greedy_equals_the_grpc_path(cluster, client, stub):
    """Token for token, completions (text and token-id prompts) and chat, streaming and not."""
    want = ids_of(grpc_generate(stub, prompt=PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True))
    kw = dict(model="smollm2", max_tokens=12, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    done = client.completions.create(prompt=PROMPT, **kw)
    assert done.choices[0].token_ids == want and done.choices[0].finish_reason == "length"
    tok = cluster.decode[0].tokenizer
    assert done.choices[0].text == tok.decode(want, skip_special=True)
    by_ids = client.completions.create(prompt=tok.encode(PROMPT), **kw)
    assert by_ids.choices[0].token_ids == want
    streamed = [c for c in client.completions.create(prompt=PROMPT, stream=True, **kw)]
    assert [t for c in streamed for t in c.choices[0].token_ids] == want
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text

    chat_msgs = [handoff_pb2.ChatMessage(**m) for m in QUESTION]
    want_msgs = grpc_generate(stub, messages=chat_msgs, max_tokens=32, temperature=0.0)
    chat = client.chat.completions.create(model="smollm2", messages=QUESTION, max_completion_tokens=32,
                                          temperature=0, extra_body={"return_token_ids": True})
    assert chat.choices[0].token_ids == ids_of(want_msgs)
    assert chat.choices[0].message.content == "".join(m.text for m in want_msgs)
    assert chat.choices[0].finish_reason == "stop" and "Paris" in chat.choices[0].message.content
    assert chat.usage.prompt_tokens == want_msgs[-1].prompt_tokens
    assert chat.usage.completion_tokens == want_msgs[-1].completion_tokens
    assert chat.system_fingerprint == f"fp_{cluster.decode[0].model.weights_id[:16]}"
    wait_idle(cluster)


def test_streaming_chat_with_usage(client):
    stream = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=32, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "stop"
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    whole = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=32, temperature=0)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_logprobs_equal_the_grpc_paths(cluster, client, stub):
    """Chat (logprobs + top_logprobs) and completions (logprobs = k) carry exactly Generate's values."""
    tok = cluster.decode[0].tokenizer
    want = grpc_generate(stub, prompt=PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True,
                         top_logprobs=3)
    want_lps = [lp for m in want for lp in m.logprobs]
    done = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                     extra_body={"ignore_eos": True})
    lp = done.choices[0].logprobs
    assert lp.tokens == [tok.decode([x.token_id]) for x in want_lps]
    assert lp.token_logprobs == [x.logprob for x in want_lps]
    for top, x in zip(lp.top_logprobs, want_lps):
        want_top = {tok.decode([t.token_id]): t.logprob for t in x.top_logprobs}
        assert top == want_top | {tok.decode([x.token_id]): x.logprob}, "the alternatives and the sampled token"
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    chat_want = grpc_generate(stub, messages=[handoff_pb2.ChatMessage(**m) for m in QUESTION], max_tokens=8,
                              temperature=0.0, logprobs=True, top_logprobs=2)
    chat_lps = [lp for m in chat_want for lp in m.logprobs]
    for stream in (False, True):
        answer = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=8, temperature=0,
                                                logprobs=True, top_logprobs=2, stream=stream)
        if stream:
            content = [e for c in answer if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        else:
            content = answer.choices[0].logprobs.content
        assert [(e.token, e.logprob) for e in content] == [(tok.decode([x.token_id]), x.logprob) for x in chat_lps]
        assert all(e.bytes == list(e.token.encode()) for e in content)
        assert [[(t.token, t.logprob) for t in e.top_logprobs] for e in content] == \
            [[(tok.decode([t.token_id]), t.logprob) for t in x.top_logprobs] for x in chat_lps]
    plain = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_n_choices_are_independent_seeded_generations(cluster, client, stub):
    """n = 3 with seed s: choice i is the gRPC request with seed s + i; usage adds the choices up."""
    seed = MAX_SEED - 1  # the third choice wraps around to 0
    done = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=seed,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in done.choices] == [0, 1, 2]
    for i, choice in enumerate(done.choices):
        want = grpc_generate(stub, prompt=PROMPT, max_tokens=8, temperature=1.0, ignore_eos=True,
                             seed=(seed + i) % (MAX_SEED + 1))
        assert choice.token_ids == ids_of(want), i
    assert len({tuple(c.token_ids) for c in done.choices}) > 1, "the choices should differ"
    assert done.usage.completion_tokens == 24
    assert done.usage.prompt_tokens == len(cluster.decode[0].tokenizer.encode(PROMPT)), "the prompt counts once"
    stream = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=6, n=2, seed=11,
                                            stream=True)
    texts = ["", ""]
    for chunk in stream:
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    whole = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=6, n=2, seed=11)
    assert texts == [c.message.content for c in whole.choices]
    wait_idle(cluster)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("chat, params, param", [
    (True, dict(temperature=-1), "temperature"),
    (True, dict(max_tokens=0), "max_tokens"),
    (True, dict(max_completion_tokens=10**6), "max_tokens"),
    (True, dict(top_p=0), "top_p"),
    (True, dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (True, dict(top_logprobs=2), "top_logprobs"),
    (True, dict(n=0), "n"),
    (True, dict(stop=[""]), "stop[0]"),
    (True, dict(seed=-1), "seed"),
    (True, dict(logit_bias={"1": 5}), "logit_bias"),
    (True, dict(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
    (True, dict(messages=[]), "messages"),
    (True, dict(stream_options={"include_usage": True}), "stream_options"),
    (True, dict(extra_body={"top_k": "ten"}), "top_k"),
    (True, dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (False, dict(prompt=["one", "two"]), "prompt"),
    (False, dict(prompt=[10**7]), "prompt"),
    (False, dict(logprobs=6, echo=True), "echo"),
    (False, dict(prompt="word " * 9000), "prompt"),
    (False, dict(extra_body={"stop_token_ids": list(range(300))}), "stop_token_ids"),
])
def test_bad_parameters_are_400_naming_them(client, chat, params, param):
    with pytest.raises(openai.BadRequestError) as err:
        if chat:
            client.chat.completions.create(**{"model": "smollm2", "messages": QUESTION, **params})
        else:
            client.completions.create(**{"model": "smollm2", "prompt": PROMPT, **params})
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body
    assert err.value.body["type"] == "invalid_request_error" and err.value.body["message"]


def test_malformed_and_oversized_bodies(cluster):
    not_json = raw(cluster, "POST", "/v1/completions", content=b"{not json")
    assert not_json.status_code == 400 and "JSON" in not_json.json()["error"]["message"]
    too_big = raw(cluster, "POST", "/v1/completions", content=b" " * (cluster.router_config.max_body_bytes + 1))
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"
    nowhere = raw(cluster, "GET", "/v1/engines")
    assert nowhere.status_code == 404 and "error" in nowhere.json()
    assert raw(cluster, "GET", "/v1/completions").status_code == 405
    deep = raw(cluster, "POST", "/v1/completions", content=b"[" * 5000)
    assert deep.status_code == 400 and "JSON" in deep.json()["error"]["message"]


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": "ab", "stop": ["\\udfff"], "max_tokens": 2}', "stop[0]"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x\\ud800"}], "max_tokens": 2}',
     "messages[0].content"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}], "max_tokens": 2}',
     "messages[0].content[0].text"),
])
def test_lone_surrogates_are_400_naming_the_parameter(cluster, route, body, param):
    """JSON may escape half a UTF-16 pair (\\ud800): no text, and it cannot be encoded. It was a 500
    ("internal error: UnicodeEncodeError ...") with a traceback in the log."""
    got = raw(cluster, "POST", route, content=body.encode())
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["param"] == param and "surrogate" in error["message"], error


def test_api_keys_are_the_grpc_ports(cluster, stub):
    """The same keys: a wrong or missing one is 401 here and UNAUTHENTICATED on gRPC."""
    with openai.OpenAI(base_url=cluster.http_url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as err:
            bad.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=2)
    assert err.value.status_code == 401 and "not valid" in err.value.body["message"]
    missing = raw(cluster, "GET", "/v1/models", headers={"Authorization": ""})
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    with pytest.raises(grpc.RpcError) as rpc:
        list(stub.Generate(handoff_pb2.GenerateRequest(prompt="hi", max_tokens=1),
                           metadata=[("authorization", "Bearer wrong")], timeout=10))
    assert rpc.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"


def test_admission_refusals_are_429(cluster, client):
    # Every generation slot of the HTTP port taken.
    slots = cluster.router.http.api.slots
    slots.total, before = 0, slots.total
    try:
        with pytest.raises(openai.RateLimitError) as err:
            client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=2)
        assert err.value.response.headers["retry-after"] == "1"
    finally:
        slots.total = before
    wait_idle(cluster)


def test_more_kv_than_any_pool_is_400_saying_the_limit(cluster, client):
    """prompt + max_tokens reserved up front, more than the decode pool holds: no retry can succeed, so it
    is a bad parameter (it was 429 with Retry-After, and clients retried it forever)."""
    pool = cluster.decode[0].engine.pool
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=4000)
    body = err.value.body
    assert body["param"] == "max_tokens" and "retry-after" not in err.value.response.headers
    assert str(pool.num_blocks * pool.block_size) in body["message"], body["message"]
    wait_idle(cluster)


def _send_head(port: int, head: str, timeout_s: float = 20.0) -> tuple[socket.socket, str]:
    """A connection that sent `head` (request line and headers, maybe part of a body) and nothing more; the
    status line the server answered with, or '' if it closed without one, within timeout_s."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    sock.sendall(head.encode())
    try:
        data = sock.recv(4096)
    except socket.timeout:
        data = b"(no answer)"
    return sock, data.decode(errors="replace").split("\r\n", 1)[0]


def _post_head(path: str, content_length: int, body: str = "") -> str:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {content_length}\r\n\r\n{body}")


def test_admission_comes_before_the_body(cluster):
    """With every generation slot taken a request is refused at its headers, not after its body arrived
    (a client that never sends its body got no answer at all)."""
    slots = cluster.router.http.api.slots
    slots.total, before = 0, slots.total
    try:
        sock, status = _send_head(cluster.router.http_port, _post_head("/v1/completions", 1000))
        sock.close()
    finally:
        slots.total = before
    assert status.startswith("HTTP/1.1 429"), status


def test_a_body_that_does_not_arrive_is_408_and_connections_are_bounded():
    """A body that stops arriving is answered 408 after body_timeout_s instead of holding its connection
    for good; connections beyond max_streams are refused (503) rather than each held open."""
    redis = EmbeddedRedis().start()
    client, _ = connect(redis.url)
    router = RouterServer(RouterConfig(host="127.0.0.1", port=0, http_port=0, max_streams=2, body_timeout_s=1.0,
                                       redis_url=redis.url), StateStore(client)).start()
    port = router.http_port
    try:
        idle = [socket.create_connection(("127.0.0.1", port), timeout=20) for _ in range(2)]
        sock, status = _send_head(port, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.close()
        assert status.startswith("HTTP/1.1 503"), status
        for s in idle:
            s.close()
        deadline = time.monotonic() + 20  # the server sees the two close
        while True:
            sock, status = _send_head(port, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.close()
            if not status.startswith("HTTP/1.1 503") or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert status.startswith("HTTP/1.1 200"), status
        t0 = time.monotonic()
        sock, status = _send_head(port, _post_head("/v1/completions", 1000, '{"prompt": "a'))
        sock.close()
        assert status.startswith("HTTP/1.1 408"), status
        assert time.monotonic() - t0 < 15
    finally:
        router.stop(grace_s=1)
        redis.stop()


def test_no_worker_is_503():
    """A router whose Redis registry lists no worker answers 503 once the queue wait is over."""
    redis = EmbeddedRedis().start()
    client, _ = connect(redis.url)
    router = RouterServer(RouterConfig(host="127.0.0.1", port=0, http_port=0, queue_timeout_s=0.5,
                                       redis_url=redis.url), StateStore(client)).start()
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="none", max_retries=0) as c:
            with pytest.raises(openai.InternalServerError) as err:
                c.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2)
        assert err.value.status_code == 503 and "no decode worker" in err.value.body["message"]
    finally:
        router.stop(grace_s=1)
        redis.stop()


def test_deadline_is_504_and_mid_stream_an_error_event(cluster, client):
    rid = f"late-{time.monotonic_ns()}"
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=900, extra_body={"ignore_eos": True},
                                  extra_headers={"X-Request-Timeout": "1.5", "X-Request-Id": rid})
    assert err.value.status_code == 504 and err.value.body["code"] == "timeout"
    wait_state(cluster, rid, RequestState.CANCELLED)  # as a gRPC deadline leaves it
    # Past the first token the status is sent: the stream ends with an error event, never a clean end.
    chunks = []
    with pytest.raises(openai.APIError, match="deadline"):
        # 900 tokens take 3 s even at 300 tokens/s (the KV pool holds them in fp32 too): the deadline comes first.
        for chunk in client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=900, stream=True,
                                               extra_body={"ignore_eos": True},
                                               extra_headers={"X-Request-Timeout": "2"}):
            chunks.append(chunk)
    assert chunks, "the deadline passed before the first token: the mid-stream path was not taken"
    bad = raw(cluster, "POST", "/v1/completions", json_body={"prompt": PROMPT}, headers={"X-Request-Timeout": "soon"})
    assert bad.status_code == 400
    wait_idle(cluster)


def test_duplicate_request_id_is_409(client):
    rid = f"dup-{time.monotonic_ns()}"
    kw = dict(model="smollm2", prompt=PROMPT, max_tokens=2, extra_headers={"X-Request-Id": rid})
    assert client.completions.create(**kw).id == rid
    with pytest.raises(openai.ConflictError) as err:
        client.completions.create(**kw)
    assert err.value.response.headers["x-should-retry"] == "false"


# --------------------------------------------------------------------------- clients that leave


def test_client_leaving_mid_stream_cancels_and_frees_kv(cluster, client):
    # Many times: a cancel that lands as a token arrives was once dropped (about one in ten), and the
    # request then decoded to the end for nobody.
    for attempt in range(12):
        rid = f"gone-{attempt}-{time.monotonic_ns()}"
        stream = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=400, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True},
                                                extra_headers={"X-Request-Id": rid})
        got = 0
        for chunk in stream:
            got += 1
            if got == 5:
                break
        assert cluster.state.get_request(rid)["state"] == RequestState.DECODING
        stream.close()
        record = wait_state(cluster, rid, RequestState.CANCELLED)
        assert 5 <= int(record["completion_tokens"]) < 400
        wait_idle(cluster)


def test_client_timing_out_on_a_whole_answer_cancels_it(cluster, client):
    rid = f"impatient-{time.monotonic_ns()}"
    # 1,500 tokens take several seconds however fast decode is (400 once finished within the 2 s: CI).
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=2.0).completions.create(
            model="smollm2", prompt=PROMPT, max_tokens=1500, extra_body={"ignore_eos": True},
            extra_headers={"X-Request-Id": rid})
    wait_state(cluster, rid, RequestState.CANCELLED)
    wait_idle(cluster)


# --------------------------------------------------------------------------- parsing, without a cluster


def test_parse_maps_openai_parameters_onto_generate_request():
    body = {"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                          {"type": "text", "text": "b"}]},
                                       {"role": "user", "content": "hi"}],
            "max_tokens": 5, "max_completion_tokens": 7, "stop": "END", "top_k": -1, "min_p": 0.1, "seed": 3,
            "logprobs": True, "top_logprobs": 4, "n": 2, "stream": True, "stream_options": {"include_usage": True},
            "user": "u-1", "ignore_eos": True, "unknown_extra": {"ignored": True}}
    parsed = openai_schema.parse_request(body, chat=True, model_names=("m",))
    r = parsed.request
    assert [(m.role, m.content) for m in r.messages] == [("system", "a\nb"), ("user", "hi")]
    assert r.max_tokens == 7 and list(r.stop) == ["END"] and r.top_k == 0 and r.HasField("top_k")
    assert r.seed == 3 and r.logprobs and r.top_logprobs == 4 and r.ignore_eos and not r.HasField("temperature")
    assert parsed.n == 2 and parsed.stream and parsed.include_usage and parsed.logprobs
    completion = openai_schema.parse_request({"prompt": [[1, 2, 3]], "logprobs": 0}, chat=False, model_names=("m",))
    assert list(completion.request.prompt_token_ids) == [1, 2, 3] and completion.request.top_logprobs == 0
    assert completion.logprobs and not completion.request.prompt


def test_validation_messages_name_openai_parameters():
    assert openai_schema.param_named_in("max_tokens (300) plus the prompt ...") == "max_tokens"
    assert openai_schema.param_named_in("stop[2] must be 1..256 characters long") == "stop[2]"
    assert openai_schema.param_named_in("prompt_token_ids holds token id 9") == "prompt"
    assert openai_schema.param_named_in("request_id must be ...") is None
    assert openai_schema.param_named_in("the KV pool ...") is None
    error = openai_schema.APIError.from_status(grpc.StatusCode.UNAVAILABLE, "down")
    assert error.status == 503 and json.loads(json.dumps(error.body()))["error"]["type"] == "server_error"
