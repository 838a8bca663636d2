"""Property-based fuzzing of every RPC a client or a peer can reach (DESIGN.md invariants 1, 2 and 5).

Requests are built as raw protobuf bytes, not through the generated classes, so the servers also see
what those classes refuse to write: invalid UTF-8 in string fields (lone surrogates), unknown and
mistyped fields, truncated or garbage messages, out-of-range varints and any float bit pattern. Each
input's expected outcome comes from an oracle written against the proto contract (handoff.proto,
internal.proto): the bytes are parsed locally and checked field by field, so a request the contract
rejects must get INVALID_ARGUMENT naming the field, a valid one must be served, and nothing may end
in UNKNOWN, INTERNAL or a hang. After all the fuzzing the cluster must still serve a greedy request
exactly as before, with every KV block free, no lease left in Redis and every worker thread alive.

Runs as one module (the last test checks the totals): about 1,350 inputs, 70-120 s on a 2-core machine.
"""
from __future__ import annotations

import collections
import math
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable

import grpc
import pytest
import torch
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.kv_wire import LAYOUT
from common.state import TERMINAL_STATES
from protos import handoff_pb2, internal_pb2
from router.cluster import Cluster
from router.config import RouterConfig

MAX_SEED = 2**63 - 1
MAX_PUBLIC_MESSAGE_BYTES = 4 << 20  # the router's receive limit (common.grpc_util)
MAX_INTERNAL_MESSAGE_BYTES = 8 << 20  # the workers' receive limit
DEFAULT_MAX_TOKENS = 3  # the fuzz cluster's router default, so requests without max_tokens stay quick
CALL_TIMEOUT_S = 30.0  # every call must end well within this; DEADLINE_EXCEEDED here means a hang
# Codes a client may see from the router, and a peer from a worker (never UNKNOWN or INTERNAL).
ROUTER_CODES = {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "ALREADY_EXISTS", "UNAVAILABLE"}
WORKER_CODES = {"OK", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "DATA_LOSS", "UNAVAILABLE", "CANCELLED",
                "RESOURCE_EXHAUSTED"}

pytestmark = pytest.mark.timeout(600)  # a hang is one of the failures looked for: end it

FUZZ = settings(deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example, HealthCheck.filter_too_much])

INPUTS: collections.Counter[str] = collections.Counter()  # inputs sent, per test
OUTCOMES: collections.Counter[str] = collections.Counter()  # "rpc status" -> inputs
_ids = iter(range(10**9))


def unique_id(prefix: str) -> str:
    return f"{prefix}-{time.monotonic_ns()}-{next(_ids)}"


# --------------------------------------------------------------------------- protobuf wire encoding

def varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # a negative int is sent as its 10-byte two's complement, as protobuf does
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def f_varint(number: int, n: int) -> bytes:
    return tag(number, 0) + varint(n)


def f_len(number: int, payload: bytes) -> bytes:
    return tag(number, 2) + varint(len(payload)) + payload


def f_fixed32(number: int, raw4: bytes) -> bytes:
    return tag(number, 5) + raw4


def f_double(number: int, x: float) -> bytes:
    return tag(number, 1) + struct.pack("<d", x)


def f_packed(number: int, values: list[int]) -> bytes:
    return f_len(number, b"".join(varint(v) for v in values))


def f32(x: float) -> bytes:
    return struct.pack("<f", x)


def int32(n: int) -> int:
    """What a proto int32 field holds after parsing a varint of n (the low 32 bits, signed)."""
    n &= 0xFFFFFFFF
    return n - (1 << 32) if n >= 1 << 31 else n


# --------------------------------------------------------------------------- strategies: field values

# All of Unicode, lone surrogates included: a client (say, in C++ or Go) can put their bytes on the wire.
ANY_CHAR = st.one_of(st.characters(exclude_categories=()), st.characters(categories=["Cs"]))
ODD_CHAR = st.sampled_from("\x00\x01\x07\x08\t\n\r\x1b\x7f\x85\xa0\u200b\u2028\u202e\ufeff\uffff\U0001f600")
UTF8_CHAR = st.one_of(st.characters(codec="utf-8"), ODD_CHAR)


def wire_text(min_size: int = 0, max_size: int = 24) -> st.SearchStrategy[bytes]:
    """Bytes for a string field: valid UTF-8 with control characters, text with lone surrogates
    (invalid UTF-8 once encoded), or arbitrary bytes."""
    return st.one_of(
        st.text(UTF8_CHAR, min_size=min_size, max_size=max_size).map(str.encode),
        st.text(st.one_of(ANY_CHAR, ODD_CHAR), min_size=min_size, max_size=max_size)
        .map(lambda s: s.encode("utf-8", "surrogatepass")),
        st.binary(min_size=min_size, max_size=max_size))


SANE_TEXT = st.text(st.characters(codec="ascii", min_codepoint=32, max_codepoint=126) | st.sampled_from("éß中😀\n"),
                    min_size=1, max_size=40)
HUGE_SIZES = st.sampled_from([3_000, 30_000, 300_000, 1_000_000, 4_300_000])  # the last is past 4 MiB


def huge(unit: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """A few KB to past the 4 MiB message limit, built from a short drawn unit (cheap to draw)."""
    return st.tuples(unit, HUGE_SIZES).map(lambda t: t[0] * max(1, t[1] // len(t[0])))


ANY_F32 = st.one_of(
    st.floats(width=32).map(f32),  # NaN, ±inf, subnormals, ±0 included
    st.integers(0, 2**32 - 1).map(lambda n: struct.pack("<I", n)),  # any bit pattern: NaN payloads
    st.sampled_from([3.4028235e38, -3.4028235e38, 1e-45, -1e-45, 1e-6, 1e-5, 10.000001, 2.0000002, 1.0000001,
                     -2.0000002]).map(f32))
ANY_VARINT = st.one_of(st.integers(-2**63, 2**64 - 1), st.sampled_from([0, -1, 1, 2**31 - 1, -2**31, 2**31, 2**32,
                                                                       2**63 - 1, 2**63, 2**64 - 1]))
SANE_FLOAT = {
    "temperature": st.one_of(st.just(0.0), st.floats(0, 2, width=32)),
    "top_p": st.floats(0.015625, 1, width=32),
    "min_p": st.floats(0, 1, width=32),
    "repetition_penalty": st.floats(0.5, 2, width=32),
    "presence_penalty": st.floats(-2, 2, width=32),
    "frequency_penalty": st.floats(-2, 2, width=32),
}
STRICT_ID = st.from_regex(r"[A-Za-z0-9._:\-]{1,24}", fullmatch=True)
ODD_REQUEST_ID = st.one_of(
    wire_text(), st.sampled_from([b"abc\n", b"a b", b"\t", b"x" * 129, b"y" * 128, b"a/b", b"\xff",
                                  "é".encode(), b"\x00", b"ok\r\n"]),
    st.integers(129, 5000).map(lambda n: b"z" * n))
ROLES = ("system", "user", "assistant")


@st.composite
def extra_fields(draw, max_size: int = 3) -> list[bytes]:
    """Fields the receiver does not know, and known field numbers sent with another wire type."""
    def one(number):
        return st.one_of(
            ANY_VARINT.map(lambda n: f_varint(number, n)),
            st.binary(min_size=4, max_size=4).map(lambda b: f_fixed32(number, b)),
            st.binary(min_size=8, max_size=8).map(lambda b: tag(number, 1) + b),
            st.binary(max_size=16).map(lambda b: f_len(number, b)))
    numbers = st.one_of(st.integers(16, 2**29 - 1), st.integers(1, 15))
    return draw(st.lists(numbers.flatmap(one), max_size=max_size))


GARBAGE = st.one_of(
    st.tuples(st.just("truncate"), st.integers(1, 12)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=12)),
    st.tuples(st.just("replace"), st.binary(max_size=64)),
    st.tuples(st.just("append"), st.sampled_from([b"\x00", b"\x03", b"\x0b", b"\x0c", b"\x0a\x7f", b"\xff\xff\xff",
                                                  tag(1, 6), tag(2**29 - 1, 7)])))


def apply_garbage(raw: bytes, garbage) -> bytes:
    if garbage is None:
        return raw
    kind, arg = garbage
    if kind == "truncate":
        return raw[:max(0, len(raw) - arg)]
    if kind == "append":
        return raw + arg
    return arg


# --------------------------------------------------------------------------- messages with late-bound parts

@dataclass
class Ctx:
    """What only the running cluster knows: addresses, epochs, a fresh request id."""

    rid: str
    decode_id: str
    decode_epoch: str
    kv_address: str
    decode_address: str
    prefill_address: str


Part = bytes | Callable[[Ctx], bytes]


@dataclass
class Spec:
    """A message as a list of encoded fields (some filled in from the Ctx), then an optional corruption."""

    parts: list[Part]
    garbage: tuple | None = None
    extra: dict = field(default_factory=dict)  # per-RPC knobs for the test (push mode, KV content, ...)

    def encode(self, ctx: Ctx) -> bytes:
        raw = b"".join(p(ctx) if callable(p) else p for p in self.parts)
        return apply_garbage(raw, self.garbage)


def maybe_wild(draw, sane: bool, sane_st, wild_st):
    """None (field unset), a sane value, or (in a wild request) anything."""
    return draw(st.one_of(st.none(), sane_st) if sane else st.one_of(st.none(), sane_st, wild_st, wild_st))


def float_field(draw, sane: bool, number: int, name: str):
    value = maybe_wild(draw, sane, SANE_FLOAT[name].map(f32), ANY_F32)
    return None if value is None else f_fixed32(number, value)


# --------------------------------------------------------------------------- GenerateRequest

@st.composite
def chat_message(draw, sane: bool) -> bytes:
    if sane:
        return f_len(1, draw(st.sampled_from(ROLES)).encode()) + f_len(2, draw(SANE_TEXT).encode())
    role = draw(st.one_of(st.sampled_from(ROLES + ("", "tool", "User", "ipython", "system ", "\x00")).map(str.encode),
                          wire_text(max_size=8), st.none()))
    content = draw(huge(wire_text(1, 4)) if draw(st.integers(0, 11)) == 0 else
                   st.one_of(wire_text(), SANE_TEXT.map(str.encode), st.none()))
    parts = [b"" if role is None else f_len(1, role), b"" if content is None else f_len(2, content),
             *draw(extra_fields(max_size=1))]
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=16))  # a garbage nested message
    return b"".join(draw(st.permutations(parts)))


@st.composite
def generate_requests(draw) -> Spec:
    sane = draw(st.integers(0, 5)) == 0  # one in six aims at a valid request; most are rejected cheaply
    parts: list[Part] = []
    if sane:
        use_prompt = draw(st.booleans())
        if use_prompt:
            parts.append(f_len(1, draw(SANE_TEXT).encode()))
        else:
            parts += [f_len(2, m) for m in draw(st.lists(chat_message(True), min_size=1, max_size=3))]
    else:
        # Huge prompts take a second to tokenize: one in twelve.
        prompt = draw(huge(wire_text(1, 6)) if draw(st.integers(0, 11)) == 0 else
                      st.one_of(st.none(), st.just(b""), wire_text(), SANE_TEXT.map(str.encode)))
        if prompt is not None:
            parts.append(f_len(1, prompt))
        if draw(st.integers(0, 2)) == 0:
            msgs = draw(st.lists(chat_message(False), max_size=4))
            repeat = draw(st.sampled_from([1, 1, 1, 60, 257, 1000]))
            parts += [f_len(2, m) for m in msgs] * repeat
    max_tokens = maybe_wild(draw, sane, st.integers(1, DEFAULT_MAX_TOKENS),
                            # never a value a generation would take seconds to fill: it must fail or be tiny
                            ANY_VARINT.filter(lambda n: not 4 <= int32(n) < 1200))
    if max_tokens is not None:
        parts.append(f_varint(3, max_tokens))
    for number, name in ((4, "temperature"), (5, "top_p"), (7, "min_p"), (8, "repetition_penalty"),
                         (9, "presence_penalty"), (10, "frequency_penalty")):
        if (value := float_field(draw, sane, number, name)) is not None:
            parts.append(value)
    if (top_k := maybe_wild(draw, sane, st.integers(0, 100), ANY_VARINT)) is not None:
        parts.append(f_varint(6, top_k))
    if (seed := maybe_wild(draw, sane, st.integers(0, MAX_SEED), ANY_VARINT)) is not None:
        parts.append(f_varint(11, seed))
    stop = maybe_wild(draw, sane, st.lists(st.text(UTF8_CHAR, min_size=1, max_size=8).map(str.encode), max_size=3),
                      st.one_of(st.lists(wire_text(), max_size=20),
                                st.tuples(wire_text(1, 8), st.sampled_from([17, 1000, 20_000])).map(
                                    lambda t: [t[0]] * t[1]),
                                st.integers(250, 2000).map(lambda n: [b"s" * n])))
    parts += [f_len(12, s) for s in stop or []]
    stop_ids = maybe_wild(draw, sane, st.lists(st.integers(0, 49151), max_size=3),
                          st.one_of(st.lists(ANY_VARINT, max_size=8),
                                    st.integers(10, 100_000).map(lambda n: list(range(n)))))
    if stop_ids:
        parts += [f_packed(13, stop_ids)] if draw(st.booleans()) else [f_varint(13, t) for t in stop_ids]
    rid = maybe_wild(draw, sane, STRICT_ID.map(str.encode), ODD_REQUEST_ID)
    if rid is not None:
        parts.append(f_len(14, rid))
    if (ignore_eos := maybe_wild(draw, sane, st.booleans().map(int), ANY_VARINT)) is not None:
        parts.append(f_varint(15, ignore_eos))
    parts += draw(extra_fields())
    if draw(st.booleans()):
        parts = draw(st.permutations(parts))
    garbage = None if sane or draw(st.integers(0, 7)) else draw(GARBAGE)
    return Spec(parts, garbage)


@dataclass
class Verdict:
    """What the contract allows for one input."""

    codes: set[str]
    hints: tuple[str, ...] = ()  # INVALID_ARGUMENT's details must name one of these
    why: str = ""
    request: object = None
    prompt_len: int = 0
    max_tokens: int = 0


def sampling_violations(s, vocab_size: int) -> list[str]:
    """Fields of a (public or internal) message outside the ranges handoff.proto documents."""
    bad = []

    def check(name, ok):
        if not ok:
            bad.append(name)

    def has(name):  # unset optional public fields take the server's default, which is valid
        try:
            return s.HasField(name)
        except ValueError:  # a field without presence (internal SamplingParams): always "set"
            return True

    def real(name, lo, hi, lo_open=False):
        if has(name):
            x = getattr(s, name)
            check(name, math.isfinite(x) and lo <= x <= hi and not (lo_open and x == lo))

    real("temperature", 0.0, math.inf)
    real("top_p", 0.0, 1.0, lo_open=True)
    real("min_p", 0.0, 1.0)
    real("repetition_penalty", 0.0, 10.0, lo_open=True)
    real("presence_penalty", -2.0, 2.0)
    real("frequency_penalty", -2.0, 2.0)
    if has("top_k"):
        check("top_k", s.top_k >= 0)
    if has("seed"):
        check("seed", s.seed <= MAX_SEED)
    check("stop", len(s.stop) <= 16 and all(1 <= len(x) <= 256 for x in s.stop))
    check("stop_token_ids", all(0 <= t < vocab_size for t in s.stop_token_ids))
    return bad


def parse(cls, raw: bytes):
    try:
        return cls.FromString(raw)
    except DecodeError:
        return None


def generate_verdict(raw: bytes, cluster, used_rids: set[str]) -> Verdict:
    if len(raw) > MAX_PUBLIC_MESSAGE_BYTES:
        return Verdict({"RESOURCE_EXHAUSTED"}, why="over the 4 MiB message limit")
    r = parse(handoff_pb2.GenerateRequest, raw)
    if r is None:
        return Verdict({"INVALID_ARGUMENT"}, why="not a parseable GenerateRequest (invalid UTF-8 or malformed)")
    tok = cluster.decode[0].tokenizer
    model = cluster.decode[0].model.config
    bad: list[str] = []  # the contract says INVALID_ARGUMENT
    loose: list[str] = []  # fields within the letter of the contract that the router may still refuse
    if r.request_id:
        rid = r.request_id
        if len(rid) > 128 or any(not 0x21 <= ord(c) <= 0x7E for c in rid):
            bad.append("request_id")  # "1 to 128 printable ASCII characters, no whitespace"
        elif not all(c.isalnum() or c in "._:-" for c in rid):
            loose.append("request_id")  # printable ASCII that the router's stricter rule refuses
    if r.prompt and r.messages:
        bad.append("either prompt or messages")
    elif not r.prompt and not r.messages:
        bad.append("prompt or messages")
    elif r.messages:
        if len(r.messages) > 256:
            bad.append("messages")
        elif any(not m.role for m in r.messages):
            bad.append("role")
        elif any(m.role not in ROLES for m in r.messages):
            loose.append("role")  # "whatever roles the model's chat template accepts"
    if r.HasField("max_tokens") and r.max_tokens < 1:
        bad.append("max_tokens")
    bad += sampling_violations(r, model.vocab_size)
    if bad:
        # The router may report a too long prompt or max_tokens first, which only tokenizing would tell.
        hints = (*bad, *loose, "context", *(["max_tokens"] if r.HasField("max_tokens") and r.max_tokens > 1 else []))
        return Verdict({"INVALID_ARGUMENT"}, hints, "violates " + ", ".join(bad), r)
    try:
        text = r.prompt or tok.apply_chat_template([{"role": m.role, "content": m.content} for m in r.messages])
        prompt_len = len(tok.encode(text))
    except ValueError:  # the chat template refused: INVALID_ARGUMENT is right
        return Verdict({"INVALID_ARGUMENT"}, ("messages", "role"), "chat template refuses", r)
    room = model.max_position - prompt_len
    max_tokens = r.max_tokens if r.HasField("max_tokens") else min(DEFAULT_MAX_TOKENS, room)
    if room < 1:
        return Verdict({"INVALID_ARGUMENT"}, ("context",), f"prompt of {prompt_len} tokens fills the context", r)
    if max_tokens > room:
        return Verdict({"INVALID_ARGUMENT"}, ("max_tokens",), "max_tokens past the context", r)
    pool = cluster.decode[0].engine.pool
    codes = {"RESOURCE_EXHAUSTED"} if pool.blocks_for(prompt_len + max_tokens) > pool.num_blocks else {"OK"}
    if r.request_id and r.request_id in used_rids:
        codes = {"ALREADY_EXISTS"}
    if loose:
        codes.add("INVALID_ARGUMENT")
    return Verdict(codes, tuple(loose), "valid" if not loose else f"valid by the letter of {loose}", r,
                   prompt_len, max_tokens)


# --------------------------------------------------------------------------- calling and judging

@dataclass
class Outcome:
    code: str
    details: str
    responses: list
    elapsed_s: float


def call_stream(method, request, timeout: float) -> Outcome:
    t0 = time.monotonic()
    responses = []
    try:
        for msg in method(request, timeout=timeout):
            responses.append(msg)
        return Outcome("OK", "", responses, time.monotonic() - t0)
    except grpc.RpcError as exc:
        return Outcome(exc.code().name, exc.details() or "", responses, time.monotonic() - t0)


def call_unary(method, request, timeout: float) -> Outcome:
    t0 = time.monotonic()
    try:
        return Outcome("OK", "", [method(request, timeout=timeout)], time.monotonic() - t0)
    except grpc.RpcError as exc:
        return Outcome(exc.code().name, exc.details() or "", [], time.monotonic() - t0)


def judge(out: Outcome, verdict: Verdict, allowed: set[str], raw: bytes, timeout: float = CALL_TIMEOUT_S,
          rpc: str = "other") -> None:
    shown = raw if len(raw) <= 300 else raw[:300] + b"...(%d bytes)" % len(raw)
    where = (f"\ninput ({len(raw)} bytes): {shown!r}\nexpected {sorted(verdict.codes)} ({verdict.why}); "
             f"got {out.code} after {out.elapsed_s:.2f} s: {out.details[:500]!r}")
    OUTCOMES[f"{rpc} {out.code}"] += 1
    assert out.code in allowed, "status outside the contract" + where
    assert out.code in verdict.codes, "wrong status" + where
    assert out.elapsed_s < timeout + 2, "call outlived its deadline" + where
    if out.code != "OK":
        assert out.details.strip(), "an error status without a message" + where
        assert "Traceback" not in out.details, "a stack trace in the status" + where
    if out.code == "INVALID_ARGUMENT" and verdict.hints:
        assert any(h in out.details for h in verdict.hints), "INVALID_ARGUMENT does not name the field" + where


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(num_prefill=1, num_decode=1, dtype="fp32", kv_memory_gib=0.05, threads=1,
                router=RouterConfig(default_max_tokens=DEFAULT_MAX_TOKENS)).start()
    yield c
    c.stop(drain_timeout_s=2)


@pytest.fixture(scope="module")
def channels(cluster):
    opts = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    d, p = cluster.decode[0], cluster.prefill[0]
    chs = {"router": grpc.insecure_channel(cluster.address, options=opts),
           "prefill": grpc.insecure_channel(f"127.0.0.1:{p.config.port}", options=opts),
           "decode": grpc.insecure_channel(f"127.0.0.1:{d.config.port}", options=opts),
           "kv": grpc.insecure_channel(d.kv_address, options=opts)}
    yield chs
    for ch in chs.values():
        ch.close()


def raw_method(channel, path: str, response_cls, kind: str = "unary_stream"):
    """A generic call that sends the given bytes as the request, unchecked."""
    return getattr(channel, kind)(path, request_serializer=lambda b: b, response_deserializer=response_cls.FromString)


def ctx_for(cluster, rid: str) -> Ctx:
    d, p = cluster.decode[0], cluster.prefill[0]
    return Ctx(rid=rid, decode_id=d.config.worker_id, decode_epoch=d.epoch, kv_address=d.kv_address,
               decode_address=f"127.0.0.1:{d.config.port}", prefill_address=f"127.0.0.1:{p.config.port}")


GREEDY_PROMPT = "Write a short list of the planets of the solar system, one per line, with a fact about each:"


def greedy(channels):
    msgs = list(raw_method(channels["router"], "/handoff.v1.Router/Generate", handoff_pb2.GenerateResponse)(
        handoff_pb2.GenerateRequest(prompt=GREEDY_PROMPT, max_tokens=12, temperature=0.0,
                                    ignore_eos=True).SerializeToString(), timeout=60))
    return [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs), msgs[-1].finish_reason


@pytest.fixture(scope="module")
def baseline(cluster, channels):
    """The greedy answer before any fuzzing; the cluster must give exactly this one afterwards."""
    return greedy(channels)


# --------------------------------------------------------------------------- 1. Router.Generate

GENERATE_USED_RIDS: set[str] = set()
ACCEPTED_RIDS: list[str] = []


@settings(FUZZ, max_examples=550)
@given(spec=generate_requests())
def test_fuzz_generate(cluster, channels, baseline, spec):
    raw = spec.encode(ctx_for(cluster, ""))
    verdict = generate_verdict(raw, cluster, GENERATE_USED_RIDS)
    INPUTS["generate"] += 1
    out = call_stream(raw_method(channels["router"], "/handoff.v1.Router/Generate", handoff_pb2.GenerateResponse),
                      raw, CALL_TIMEOUT_S)
    judge(out, verdict, ROUTER_CODES, raw, rpc="generate")
    r = verdict.request
    if r is not None and r.request_id and out.code in ("OK", "RESOURCE_EXHAUSTED", "UNAVAILABLE"):
        GENERATE_USED_RIDS.add(r.request_id)
        ACCEPTED_RIDS.append(r.request_id)
    if out.code != "OK":
        return
    msgs = out.responses
    assert msgs, "a successful stream with no message"
    last = msgs[-1]
    assert last.finish_reason in (handoff_pb2.FINISH_REASON_STOP, handoff_pb2.FINISH_REASON_LENGTH), last
    assert all(m.finish_reason == handoff_pb2.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
    ids = [t for m in msgs for t in m.token_ids]
    assert len(ids) <= verdict.max_tokens and last.completion_tokens <= verdict.max_tokens
    assert all(0 <= t < cluster.decode[0].model.config.vocab_size for t in ids)
    assert last.prompt_tokens == verdict.prompt_len
    assert len({m.request_id for m in msgs}) == 1 and msgs[0].request_id
    if r.request_id:
        assert last.request_id == r.request_id
    else:
        ACCEPTED_RIDS.append(last.request_id)
    if r.HasField("seed"):
        assert last.seed == r.seed


# --------------------------------------------------------------------------- 2a. PrefillWorker.Prefill

def pick(draw, sane: bool, sane_st, wild_st, odds: int = 4):
    """A sane value, or in a wild message, once in `odds` fields, a wild one: near-valid messages get
    past the first check and reach the code behind it."""
    return draw(sane_st if sane or draw(st.integers(0, odds - 1)) else wild_st)


@st.composite
def internal_sampling(draw, sane: bool, max_tokens=st.integers(1, 4),
                      wild_max_tokens=st.one_of(ANY_VARINT, st.none())) -> bytes:
    """An internal SamplingParams: every field set (the router resolves defaults), or anything."""
    parts = []
    for number, name in ((1, "temperature"), (2, "top_p"), (4, "min_p"), (5, "repetition_penalty"),
                         (6, "presence_penalty"), (7, "frequency_penalty")):
        value = pick(draw, sane, SANE_FLOAT[name].map(f32), st.one_of(ANY_F32, st.none()))
        if value is not None:
            parts.append(f_fixed32(number, value))
    for number, value_st, wild_st in ((3, st.integers(0, 100), st.one_of(ANY_VARINT, st.none())),
                                      (8, st.integers(0, MAX_SEED), st.one_of(ANY_VARINT, st.none())),
                                      (9, max_tokens, wild_max_tokens)):
        value = pick(draw, sane, value_st, wild_st)
        if value is not None:
            parts.append(f_varint(number, value))
    stop = pick(draw, sane, st.lists(st.text(UTF8_CHAR, min_size=1, max_size=6).map(str.encode), max_size=2),
                st.one_of(st.lists(wire_text(), max_size=18), st.just([b"s" * 300])))
    parts += [f_len(10, s) for s in stop]
    parts.append(f_packed(11, pick(draw, sane, st.lists(st.integers(0, 49151), max_size=3),
                                   st.lists(ANY_VARINT, max_size=3))))
    parts.append(f_varint(12, pick(draw, sane, st.booleans().map(int), ANY_VARINT)))
    if not sane:
        parts += draw(extra_fields(max_size=2))
        parts = draw(st.permutations(parts))
    return b"".join(parts)


SANE_IDS = st.lists(st.integers(0, 49151), min_size=1, max_size=24)
WILD_IDS = st.one_of(
    st.lists(st.one_of(st.integers(0, 49151), ANY_VARINT), max_size=24),
    st.just([]),
    # Past the context (8,191 tokens): rejected before any compute. Lengths in between are never
    # drawn, as a prefill of thousands of tokens takes seconds here.
    st.tuples(st.integers(0, 49151), st.integers(8192, 9000)).map(lambda t: [t[0]] * t[1]))


def id_part(number: int, choice) -> Part:
    """The request id field: a fresh unique one, or a drawn (possibly invalid) one."""
    if choice is None:
        return lambda c: f_len(number, c.rid.encode())
    return f_len(number, choice)


@st.composite
def prefill_requests(draw) -> Spec:
    sane = draw(st.integers(0, 3)) == 0
    rid = pick(draw, sane, st.none(), st.one_of(wire_text(), st.just(b"")))
    ids = pick(draw, sane, SANE_IDS, WILD_IDS)
    parts: list[Part] = [id_part(1, rid)]
    parts += [f_packed(2, ids)] if draw(st.booleans()) else [f_varint(2, t) for t in ids]
    if sane or draw(st.integers(0, 5)):
        parts.append(f_len(3, draw(internal_sampling(sane or draw(st.booleans()), max_tokens=st.integers(1, 8)))))
    # The target: the real decode worker, or any field wrong.
    worker = pick(draw, sane, st.just("real"), st.one_of(st.just(b""), wire_text(max_size=8)))
    address = pick(draw, sane, st.just("real"), st.one_of(
        st.sampled_from(["decode-main", "prefill", "refused"]),
        st.sampled_from([b"", b"nonsense", b":::", b"unix:/nonexistent", b"127.0.0.1:99999", b"dns:///", b"[::1"]),
        # Any port on this host: mostly refused, now and then another service of the cluster.
        st.integers(1, 65535).map(lambda port: f"127.0.0.1:{port}".encode())), odds=2)
    epoch = pick(draw, sane, st.just("real"), st.one_of(st.just(b""), wire_text(max_size=8)))
    reservation = draw(wire_text(max_size=8))

    def target(c: Ctx) -> bytes:
        addresses = {"real": c.kv_address, "decode-main": c.decode_address, "prefill": c.prefill_address,
                     "refused": "127.0.0.1:1"}
        a = addresses[address].encode() if isinstance(address, str) else address
        w = c.decode_id.encode() if worker == "real" else worker
        e = c.decode_epoch.encode() if epoch == "real" else epoch
        return f_len(4, f_len(1, w) + f_len(2, a) + f_len(3, e) + f_len(4, reservation))

    if sane or draw(st.integers(0, 5)):
        parts.append(target)
    if not sane:
        parts += draw(extra_fields(max_size=2))
    garbage = None if sane or draw(st.integers(0, 7)) else draw(GARBAGE)
    return Spec(parts, garbage, {"target": (worker, address, epoch)})


def id_violations(ids, vocab_size: int, max_len: int, name: str) -> list[str]:
    ids = list(ids)
    return [name] if not ids or len(ids) > max_len or any(not 0 <= t < vocab_size for t in ids) else []


PREFILL_USED_RIDS: set[str] = set()


def prefill_verdict(raw: bytes, spec: Spec, cluster) -> Verdict:
    r = parse(internal_pb2.PrefillRequest, raw)
    if r is None:
        return Verdict({"INVALID_ARGUMENT"}, why="not a parseable PrefillRequest")
    cfg = cluster.prefill[0].model.config
    bad = sampling_violations(r.sampling, cfg.vocab_size)
    if r.sampling.max_tokens < 1:
        bad.append("max_tokens")
    bad += id_violations(r.prompt_ids, cfg.vocab_size, cfg.max_position - 1, "prompt_ids")
    t = r.target
    if not (t.worker_id and t.kv_address and t.epoch):
        bad.append("target")
    if bad:
        return Verdict({"INVALID_ARGUMENT"}, tuple(bad), "violates " + ", ".join(bad), r)
    d = cluster.decode[0]
    if (t.worker_id, t.kv_address, t.epoch) == (d.config.worker_id, d.kv_address, d.epoch) and r.request_id:
        if r.request_id in PREFILL_USED_RIDS:
            # The decode worker remembers a finished request id for a while and refuses its KV again.
            return Verdict({"OK", "CANCELLED"}, why="valid, but its request id was used before", request=r)
        return Verdict({"OK"}, why="valid, pushed to the real decode worker", request=r)
    # The push goes wrong downstream; prefill must say how, with a clean status.
    return Verdict(WORKER_CODES - {"OK"} | {"UNIMPLEMENTED", "OK"}, why="valid but a bad target", request=r)


@settings(FUZZ, max_examples=230)
@given(spec=prefill_requests())
def test_fuzz_prefill(cluster, channels, baseline, spec):
    rid = unique_id("pf")
    raw = spec.encode(ctx_for(cluster, rid))
    verdict = prefill_verdict(raw, spec, cluster)
    INPUTS["prefill"] += 1
    out = call_stream(raw_method(channels["prefill"], "/handoff.v1.PrefillWorker/Prefill",
                                 internal_pb2.PrefillEvent), raw, CALL_TIMEOUT_S)
    # UNIMPLEMENTED: the target was a server without KVTransfer (the prefill worker itself).
    judge(out, verdict, WORKER_CODES | {"UNIMPLEMENTED"}, raw, rpc="prefill")
    if verdict.request is not None:
        PREFILL_USED_RIDS.add(verdict.request.request_id)
    if out.code != "OK":
        return
    r = verdict.request
    first, done = out.responses
    assert first.HasField("first_token") and done.HasField("transfer_done")
    assert 0 <= first.first_token.token_id < cluster.prefill[0].model.config.vocab_size
    fp = cluster.decode[0].fingerprint()
    assert done.transfer_done.kv_bytes == fp.kv_bytes(len(r.prompt_ids))
    if r.target.kv_address == cluster.decode[0].kv_address:
        claim_kv(channels, cluster, r.request_id, list(r.prompt_ids), first.first_token.token_id)


def claim_kv(channels, cluster, rid: str, prompt_ids: list[int], first_token_id: int) -> None:
    """Take a pushed KV off the decode worker's inbox: a Decode that ends at once (max_tokens 1)."""
    req = internal_pb2.DecodeRequest(
        request_id=rid, epoch=cluster.decode[0].epoch, prompt_ids=prompt_ids, first_token_id=first_token_id,
        sampling=internal_pb2.SamplingParams(temperature=0, top_p=1, repetition_penalty=1, max_tokens=1,
                                             ignore_eos=True),
        kv_wait_s=5)
    out = call_stream(raw_method(channels["decode"], "/handoff.v1.DecodeWorker/Decode", internal_pb2.DecodeEvent),
                      req.SerializeToString(), CALL_TIMEOUT_S)
    assert out.code == "OK", f"claiming the KV of {rid}: {out.code} {out.details}"
    assert out.responses[-1].finish_reason == handoff_pb2.FINISH_REASON_LENGTH


# --------------------------------------------------------------------------- 2b. DecodeWorker.Decode

KV_CONTENTS = st.sampled_from(["zeros", "normal", "bytes", "nan", "inf", "max"])


def kv_tensor(fp, num_tokens: int, content: str, seed: int) -> torch.Tensor:
    shape = (fp.num_layers, 2, num_tokens, fp.num_kv_heads, fp.head_dim)
    g = torch.Generator().manual_seed(seed)
    if content == "zeros":
        return torch.zeros(shape, dtype=fp.torch_dtype)
    if content == "normal":
        return torch.randn(shape, generator=g).to(fp.torch_dtype)
    if content == "bytes":  # any bit pattern: NaNs, infinities, subnormals
        n = math.prod(shape) * fp.torch_dtype.itemsize
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(fp.torch_dtype).view(shape)
    value = {"nan": math.nan, "inf": math.inf, "max": 3e38}[content]
    return torch.full(shape, value, dtype=fp.torch_dtype)


def kv_messages(fp, kv: torch.Tensor, *, rid: str, worker_id: str, epoch: str, chunk_bytes: int,
                reservation_id: str = "") -> list[internal_pb2.KVChunk]:
    """A well-formed push, as messages (not a lazy iterator) so a test can tamper with them."""
    payload = kv.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    num_chunks = -(-len(payload) // chunk_bytes)
    msgs = [internal_pb2.KVChunk(header=internal_pb2.KVHeader(
        request_id=rid, target_worker_id=worker_id, target_epoch=epoch, fingerprint=fp.to_pb(),
        num_tokens=kv.shape[2], total_bytes=len(payload), num_chunks=num_chunks, layout=LAYOUT,
        reservation_id=reservation_id))]
    for i in range(num_chunks):
        piece = payload[i * chunk_bytes:(i + 1) * chunk_bytes]
        msgs.append(internal_pb2.KVChunk(data=internal_pb2.KVData(index=i, offset=i * chunk_bytes, payload=piece,
                                                                   crc32=zlib.crc32(piece))))
    return msgs


def push(channels, messages: list[bytes], timeout: float = CALL_TIMEOUT_S) -> Outcome:
    method = raw_method(channels["kv"], "/handoff.v1.KVTransfer/PushKV", internal_pb2.PushKVReply, "stream_unary")
    return call_unary(method, iter(messages), timeout)


@st.composite
def decode_requests(draw) -> Spec:
    sane = draw(st.integers(0, 2)) == 0
    with_kv = draw(st.booleans())  # push the KV first, so that a valid request really decodes
    # Without KV, also lengths the context takes but the KV pool (1,152 tokens) cannot.
    ids = draw(SANE_IDS) if with_kv else pick(draw, sane, SANE_IDS, st.one_of(WILD_IDS, st.tuples(
        st.integers(0, 49151), st.integers(1100, 8191)).map(lambda t: [t[0]] * t[1])))
    parts: list[Part] = [id_part(1, None)]
    epoch = pick(draw, sane, st.just("real"), wire_text(max_size=8))
    parts.append((lambda c: f_len(2, c.decode_epoch.encode())) if epoch == "real" else f_len(2, epoch))
    parts += [f_packed(3, ids)] if draw(st.booleans()) else [f_varint(3, t) for t in ids]
    parts.append(f_varint(4, pick(draw, sane, st.integers(0, 49151), ANY_VARINT)))
    if sane or draw(st.integers(0, 5)):
        # With KV, max_tokens stays small (or 0 once truncated to uint32): a valid request then decodes
        # a few tokens, never thousands.
        mt, wild_mt = ((st.integers(1, 5), st.sampled_from([None, 0, 2**32, 2**64 - 2**32])) if with_kv else
                       (st.integers(1, 10**6), st.one_of(ANY_VARINT, st.none())))
        parts.append(f_len(5, draw(internal_sampling(sane or draw(st.booleans()), max_tokens=mt,
                                                     wild_max_tokens=wild_mt))))
    parts.append(f_varint(6, pick(draw, sane, st.integers(0, max(0, len(ids) - 1)), ANY_VARINT)))
    wait = pick(draw, sane, st.floats(0.01, 0.2), st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([0.0, -0.0, -1.0, 1e-300, 5e-324, 1e300, math.inf, -math.inf, math.nan, 3.0])))
    parts.append(f_double(7, wait))
    if not sane:
        parts += draw(extra_fields(max_size=2))
    garbage = None if sane or draw(st.integers(0, 9)) else draw(GARBAGE)
    kv_tokens = len(ids) if draw(st.integers(0, 5)) else draw(st.integers(1, 30))
    return Spec(parts, garbage, {"with_kv": with_kv and bool(ids), "kv_tokens": kv_tokens,
                                 "content": draw(KV_CONTENTS), "seed": draw(st.integers(0, 2**31))})


def decode_verdict(raw: bytes, spec: Spec, cluster) -> tuple[Verdict, float]:
    """The verdict and the client timeout to use."""
    r = parse(internal_pb2.DecodeRequest, raw)
    if r is None:
        return Verdict({"INVALID_ARGUMENT"}, why="not a parseable DecodeRequest"), CALL_TIMEOUT_S
    d = cluster.decode[0]
    cfg = d.model.config
    bad = sampling_violations(r.sampling, cfg.vocab_size)
    if r.sampling.max_tokens < 1:
        bad.append("max_tokens")
    bad += id_violations(r.prompt_ids, cfg.vocab_size, cfg.max_position - 1, "prompt_ids")
    bad += id_violations([r.first_token_id], cfg.vocab_size, 1, "first_token_id")
    if r.prompt_ids and r.num_generated >= len(r.prompt_ids):
        bad.append("num_generated")
    if not (math.isfinite(r.kv_wait_s) and r.kv_wait_s >= 0):
        bad.append("kv_wait_s")  # "> 0"; 0 (unset) is taken as the worker's default
    if r.epoch != d.epoch:
        return Verdict({"FAILED_PRECONDITION"} | ({"INVALID_ARGUMENT"} if bad else set()),
                       why="another epoch", request=r), CALL_TIMEOUT_S
    if bad:
        return Verdict({"INVALID_ARGUMENT"}, tuple(bad), "violates " + ", ".join(bad), r), CALL_TIMEOUT_S
    pool = d.engine.pool
    # The most tokens the sequence can come to hold (what the router would reserve for it).
    num_tokens = max(len(r.prompt_ids) + 1, min(len(r.prompt_ids) - r.num_generated + r.sampling.max_tokens,
                                                cfg.max_position))
    if pool.blocks_for(num_tokens) > pool.num_blocks:
        return Verdict({"RESOURCE_EXHAUSTED"}, why="can outgrow the whole KV pool", request=r), CALL_TIMEOUT_S
    if spec.extra["with_kv"]:
        if spec.extra["kv_tokens"] != len(r.prompt_ids):
            return Verdict({"INVALID_ARGUMENT"}, ("tokens",), "KV of another length", r), CALL_TIMEOUT_S
        return Verdict({"OK"}, why="valid, with its KV", request=r), CALL_TIMEOUT_S
    wait_s = r.kv_wait_s or d.config.kv_wait_s
    if wait_s > 1.0:  # the worker waits for the KV up to the deadline: give it a short one
        return Verdict({"DEADLINE_EXCEEDED", "UNAVAILABLE"}, why="waits for KV that never comes",
                       request=r), 0.5
    return Verdict({"UNAVAILABLE"}, why="valid, but no KV arrives", request=r), CALL_TIMEOUT_S


@settings(FUZZ, max_examples=230)
@given(spec=decode_requests())
def test_fuzz_decode(cluster, channels, baseline, spec):
    d = cluster.decode[0]
    rid = unique_id("dc")
    if spec.extra["with_kv"]:
        fp = d.fingerprint()
        kv = kv_tensor(fp, spec.extra["kv_tokens"], spec.extra["content"], spec.extra["seed"])
        msgs = kv_messages(fp, kv, rid=rid, worker_id=d.config.worker_id, epoch=d.epoch, chunk_bytes=1 << 20)
        pushed = push(channels, [m.SerializeToString() for m in msgs])
        assert pushed.code == "OK", pushed
    raw = spec.encode(ctx_for(cluster, rid))
    verdict, timeout = decode_verdict(raw, spec, cluster)
    INPUTS["decode"] += 1
    out = call_stream(raw_method(channels["decode"], "/handoff.v1.DecodeWorker/Decode", internal_pb2.DecodeEvent),
                      raw, timeout)
    judge(out, verdict, WORKER_CODES | {"DEADLINE_EXCEEDED"} if timeout < CALL_TIMEOUT_S else WORKER_CODES,
          raw, timeout, rpc="decode")
    if out.code != "OK":
        return
    r = verdict.request
    events = out.responses
    assert events and events[-1].HasField("finish_reason")
    assert all(not e.HasField("finish_reason") for e in events[:-1])
    ids = [t for e in events for t in e.token_ids]
    assert all(0 <= t < d.model.config.vocab_size for t in ids)
    # Completion tokens so far: num_generated earlier ones plus first_token_id.
    prompt_len = len(r.prompt_ids) - r.num_generated
    max_output = min(r.sampling.max_tokens, d.model.config.max_position - prompt_len)
    assert len(ids) <= max(0, max_output - r.num_generated - 1), (len(ids), r)


# --------------------------------------------------------------------------- 2c. KVTransfer.PushKV

FINGERPRINT_FIELDS = ("weights_id", "num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")
HARMFUL = st.one_of(
    st.sampled_from(["truncate", "drop", "duplicate", "swap", "data_first", "no_header", "two_headers",
                     "header_last", "empty_stream", "bad_crc", "flip_byte", "grow_chunk", "empty_chunk",
                     "bad_offset", "bad_index", "empty_message", "garbage", "bad_utf8_id", "no_request_id",
                     "other_worker", "other_epoch", "no_fingerprint", "layout", "num_tokens", "total_bytes",
                     "num_chunks", "zero_chunks", "ten_gb", "ten_gb_exact", "oversized_chunk", "past_pool"]),
    st.tuples(st.just("fingerprint"), st.sampled_from(FINGERPRINT_FIELDS)))
BENIGN = st.sampled_from(["unknown_fields", "reservation_id"])


@st.composite
def push_specs(draw):
    harmful = draw(st.lists(HARMFUL, max_size=3, unique_by=str))
    benign = draw(st.lists(BENIGN, max_size=2, unique=True))
    if not harmful and not benign and draw(st.booleans()):
        harmful = [draw(HARMFUL)]
    return dict(num_tokens=draw(st.integers(1, 8)), chunk_bytes=draw(st.sampled_from([1 << 20, 65536, 10_007, 4096])),
                content=draw(KV_CONTENTS), seed=draw(st.integers(0, 2**31)), harmful=harmful, benign=benign,
                pick=draw(st.randoms(use_true_random=False)), junk=draw(st.binary(min_size=1, max_size=32)))


def tamper(s: dict, msgs: list[internal_pb2.KVChunk], fp, pool_tokens: int) -> tuple[list[bytes], list[str]]:
    """Apply the spec's mutations; the stream as bytes and the mutations that really changed something."""
    rnd = s["pick"]
    header = msgs[0].header
    data = [m.data for m in msgs[1:]]
    applied = []
    for m in s["harmful"]:
        kind, arg = (m if isinstance(m, tuple) else (m, None))
        n = len(data)
        i = rnd.randrange(n) if n else None
        if kind in ("data_first", "header_last", "no_header", "two_headers", "empty_stream", "empty_message",
                    "garbage", "bad_utf8_id"):
            pass  # applied to the encoded stream below
        elif n == 0 and kind in ("truncate", "drop", "duplicate", "bad_crc", "flip_byte", "grow_chunk",
                                 "empty_chunk", "bad_offset", "bad_index", "oversized_chunk"):
            continue
        elif kind == "truncate":
            del data[i:]
        elif kind == "drop":
            del data[i]
        elif kind == "duplicate":
            data.insert(i + 1, internal_pb2.KVData.FromString(data[i].SerializeToString()))
        elif kind == "swap":
            if n < 2:
                continue
            i, j = rnd.sample(range(n), 2)
            data[i], data[j] = data[j], data[i]
        elif kind == "bad_crc":
            data[i].crc32 ^= rnd.randrange(1, 2**32)
        elif kind == "flip_byte":
            p = bytearray(data[i].payload)
            p[rnd.randrange(len(p))] ^= 1 << rnd.randrange(8)
            data[i].payload = bytes(p)
        elif kind == "grow_chunk":
            data[i].payload += s["junk"]
            data[i].crc32 = zlib.crc32(data[i].payload)
        elif kind == "empty_chunk":
            data[i].payload, data[i].crc32 = b"", 0
        elif kind == "bad_offset":
            data[i].offset += rnd.choice([1, 7, 2**40])
        elif kind == "bad_index":
            data[i].index += rnd.randrange(1, 5)
        elif kind == "oversized_chunk":  # past the 8 MiB message limit
            data[i].payload = bytes(MAX_INTERNAL_MESSAGE_BYTES + (1 << 20))
            data[i].crc32 = zlib.crc32(data[i].payload)
        elif kind == "no_request_id":
            header.request_id = ""
        elif kind == "other_worker":
            header.target_worker_id += "x"
        elif kind == "other_epoch":
            header.target_epoch = "0" * 16 if header.target_epoch != "0" * 16 else "1" * 16
        elif kind == "no_fingerprint":
            header.ClearField("fingerprint")
        elif kind == "fingerprint":
            if not header.HasField("fingerprint"):
                continue
            f = header.fingerprint
            if arg == "dtype":
                f.dtype = "bfloat16" if f.dtype != "bfloat16" else "float16"
            elif arg == "weights_id":
                f.weights_id = rnd.choice(["", "other-model", f.weights_id + " "])
            else:
                setattr(f, arg, rnd.choice([0, getattr(f, arg) + 1, getattr(f, arg) + 2**31]))
        elif kind == "layout":
            header.layout = rnd.choice(["", "LT2HD", "l2thd", "L2THD "])
        elif kind == "num_tokens":
            header.num_tokens = rnd.choice([0, header.num_tokens + 1, 2**32 - 1])
        elif kind == "total_bytes":
            header.total_bytes = rnd.choice([0, header.total_bytes + 1, header.total_bytes - 1, 2**64 - 1])
        elif kind == "num_chunks":
            header.num_chunks = rnd.choice([header.num_chunks + 1, 2**32 - 1, header.num_chunks + 7])
        elif kind == "zero_chunks":
            header.num_chunks = 0
        elif kind == "ten_gb":
            header.total_bytes = 10 * 10**9
        elif kind == "ten_gb_exact":  # a header that is self-consistent and asks for 10 GB
            header.num_tokens = 10 * 10**9 // fp.kv_bytes(1)
            header.total_bytes = fp.kv_bytes(header.num_tokens)
            header.num_chunks = -(-header.total_bytes // (1 << 20))
        elif kind == "past_pool":  # consistent, within the context, but more tokens than the KV pool holds
            header.num_tokens = pool_tokens + 1
            header.total_bytes = fp.kv_bytes(header.num_tokens)
            header.num_chunks = -(-header.total_bytes // (1 << 20))
        else:
            raise AssertionError(kind)
        applied.append(kind)
    if "reservation_id" in s["benign"]:
        header.reservation_id = "some-other-reservation"
    kinds = set(applied)
    head = internal_pb2.KVChunk(header=header).SerializeToString()
    if "bad_utf8_id" in kinds:
        # The request id as invalid UTF-8 (a lone surrogate), which protobuf Python refuses to write.
        head = f_len(1, header.SerializeToString() + f_len(1, b"\xed\xa0\x80bad"))
    raw = [head] + [internal_pb2.KVChunk(data=d).SerializeToString() for d in data]
    if "unknown_fields" in s["benign"]:
        raw = [r + f_varint(rnd.randrange(16, 2**29), rnd.randrange(2**64)) for r in raw]
        head = raw[0]
    if "data_first" in kinds and len(raw) > 1:
        raw[0], raw[1] = raw[1], raw[0]
    if "header_last" in kinds:
        raw.remove(head)
        raw.append(head)
    if "two_headers" in kinds:
        raw.insert(rnd.randrange(1, len(raw) + 1), head)
    if "no_header" in kinds:
        raw.remove(head)
    if "empty_message" in kinds:
        raw.insert(rnd.randrange(len(raw) + 1), b"")
    if "garbage" in kinds:
        raw.insert(rnd.randrange(len(raw) + 1), s["junk"])
    if "empty_stream" in kinds:
        raw = []
    return raw, applied


@settings(FUZZ, max_examples=260)
@given(s=push_specs())
def test_fuzz_push_kv(cluster, channels, baseline, s):
    d = cluster.decode[0]
    fp = d.fingerprint()
    rid = unique_id("kv")
    kv = kv_tensor(fp, s["num_tokens"], s["content"], s["seed"])
    msgs = kv_messages(fp, kv, rid=rid, worker_id=d.config.worker_id, epoch=d.epoch, chunk_bytes=s["chunk_bytes"])
    pool = d.engine.pool
    raw, applied = tamper(s, msgs, fp, pool.num_blocks * pool.block_size)
    INPUTS["push_kv"] += 1
    out = push(channels, raw)
    verdict = Verdict({"OK"} if not applied else WORKER_CODES - {"OK"}, why=f"mutations {applied} + {s['benign']}")
    judge(out, verdict, WORKER_CODES, b"".join(raw[:3])[:200] + f" ... {applied}".encode(), rpc="push_kv")
    if out.code == "OK":
        reply = out.responses[0]
        assert (reply.request_id, reply.num_tokens, reply.kv_bytes) == (rid, s["num_tokens"],
                                                                        fp.kv_bytes(s["num_tokens"]))
        claim_kv(channels, cluster, rid, [1] * s["num_tokens"], 2)
    else:
        # A rejected push leaves nothing behind: the Decode for it must not find any KV.
        assert rid not in d.inbox._parked, f"rejected push of {rid} was parked anyway ({applied})"


# --------------------------------------------------------------------------- explicit cases, concurrency

def test_named_edge_cases(cluster, channels, baseline):
    """The inputs the brief names, each once, so they run whatever hypothesis draws."""
    gen = raw_method(channels["router"], "/handoff.v1.Router/Generate", handoff_pb2.GenerateResponse)
    cases = [
        f_len(1, "lone surrogate \ud800 here".encode("utf-8", "surrogatepass")),   # invalid UTF-8 prompt
        f_len(1, b"\xff\xfe\xfd"),
        f_len(1, b"hi") + f_len(14, b"abc\n"),                                      # whitespace in request_id
        f_len(1, b"hi") + f_len(14, b"\xed\xb0\x80"),
        f_len(1, b"a" * (5 << 20)),                                                  # past 4 MiB
        f_len(1, b"hi") + f_fixed32(4, f32(math.nan)),
        f_len(1, b"hi") + f_fixed32(5, f32(math.inf)),
        f_len(1, b"hi") + f_varint(3, -1),
        f_len(1, b"hi") + f_varint(11, 2**64 - 1),
        f_len(1, b"hi") + b"".join(f_len(12, b"x") for _ in range(10_000)),          # a huge stop list
        f_len(2, f_len(1, b"user") + f_len(2, b"\xc0\x80")),                         # overlong NUL in a message
        f_len(2, f_len(2, b"no role")),
        f_len(1, b"hi") + f_varint(123456, 7) + f_len(99999, b"\x00" * 100),        # unknown fields
        b"\x0a",                                                                      # truncated
        tag(0, 0) + b"\x00",                                                          # field number 0
    ]
    for raw in cases:
        INPUTS["named"] += 1
        judge(call_stream(gen, raw, CALL_TIMEOUT_S), generate_verdict(raw, cluster, set()), ROUTER_CODES, raw)

    d = cluster.decode[0]
    dec = raw_method(channels["decode"], "/handoff.v1.DecodeWorker/Decode", internal_pb2.DecodeEvent)
    sp = internal_pb2.SamplingParams(temperature=0, top_p=1, repetition_penalty=1, max_tokens=2)
    for wait, code in ((math.nan, "INVALID_ARGUMENT"), (-1.0, "INVALID_ARGUMENT"), (math.inf, "INVALID_ARGUMENT")):
        raw = internal_pb2.DecodeRequest(request_id=unique_id("w"), epoch=d.epoch, prompt_ids=[1, 2], first_token_id=3,
                                         sampling=sp, kv_wait_s=wait).SerializeToString()
        INPUTS["named"] += 1
        out = call_stream(dec, raw, 3.0)
        assert out.code == code, f"kv_wait_s={wait}: {out}"
    # A Decode larger than the whole KV pool must fail at once, not wait in the engine forever.
    pool = d.engine.pool
    too_many = pool.num_blocks * pool.block_size
    rid = unique_id("big")
    raw = internal_pb2.DecodeRequest(request_id=rid, epoch=d.epoch, prompt_ids=[1] * too_many, first_token_id=3,
                                     sampling=sp, kv_wait_s=5).SerializeToString()
    INPUTS["named"] += 1
    out = call_stream(dec, raw, 10.0)
    assert out.code == "RESOURCE_EXHAUSTED", out
    assert not d.engine.waiting, "a sequence larger than the pool is queued in the engine"
    # ...and so must one whose max_tokens would outgrow the pool (it used to fail halfway, INTERNAL).
    rid = unique_id("long")
    raw = internal_pb2.DecodeRequest(request_id=rid, epoch=d.epoch, prompt_ids=[1, 2, 3], first_token_id=3,
                                     sampling=replace_sampling(sp, max_tokens=too_many), kv_wait_s=5)
    INPUTS["named"] += 1
    out = call_stream(dec, raw.SerializeToString(), 10.0)
    assert out.code == "RESOURCE_EXHAUSTED", out

    # A push bigger than the pool could ever hold is refused at its header, before its buffer is allocated.
    fp = d.fingerprint()
    header = internal_pb2.KVHeader(request_id=unique_id("huge"), target_worker_id=d.config.worker_id,
                                   target_epoch=d.epoch, fingerprint=fp.to_pb(), num_tokens=too_many,
                                   total_bytes=fp.kv_bytes(too_many), num_chunks=1, layout=LAYOUT)
    INPUTS["named"] += 1
    out = push(channels, [internal_pb2.KVChunk(header=header).SerializeToString()])
    assert out.code == "INVALID_ARGUMENT" and "exceeds the limit" in out.details, out

    # Pushes to many addresses (junk, or decode pods long gone) must not leave a channel open per address.
    p = cluster.prefill[0]
    pre = raw_method(channels["prefill"], "/handoff.v1.PrefillWorker/Prefill", internal_pb2.PrefillEvent)
    for port in range(1, p.kv_channels.max_idle + 9):
        target = internal_pb2.KVTarget(worker_id=d.config.worker_id, kv_address=f"127.0.0.1:{port}", epoch=d.epoch)
        raw = internal_pb2.PrefillRequest(request_id=unique_id("addr"), prompt_ids=[1, 2, 3], sampling=sp,
                                          target=target).SerializeToString()
        INPUTS["named"] += 1
        out = call_stream(pre, raw, CALL_TIMEOUT_S)
        judge(out, Verdict({"UNAVAILABLE"}, why="nothing listens there"), WORKER_CODES, raw)
    assert len(p.kv_channels._channels) <= p.kv_channels.max_idle, f"{len(p.kv_channels._channels)} channels kept open"


def replace_sampling(sp: internal_pb2.SamplingParams, **fields) -> internal_pb2.SamplingParams:
    copy = internal_pb2.SamplingParams()
    copy.CopyFrom(sp)
    for name, value in fields.items():
        setattr(copy, name, value)
    return copy


def test_concurrent_duplicate_ids(cluster, channels, baseline):
    """A second call with the id of one still running (a buggy or replaying caller) is refused at once,
    and leaves the first alone: it used to fail in the engine (INTERNAL) and, ending, cancel the first."""
    d = cluster.decode[0]
    fp = d.fingerprint()
    dec = raw_method(channels["decode"], "/handoff.v1.DecodeWorker/Decode", internal_pb2.DecodeEvent)
    pre = raw_method(channels["prefill"], "/handoff.v1.PrefillWorker/Prefill", internal_pb2.PrefillEvent)

    def start(method, raw) -> tuple[threading.Thread, list[Outcome]]:
        out: list[Outcome] = []
        t = threading.Thread(target=lambda: out.append(call_stream(method, raw, CALL_TIMEOUT_S)))
        t.start()
        return t, out

    # Decode: the second arrives while the first is decoding (about a second for 30 tokens).
    rid, ids, max_tokens = unique_id("dup"), [5, 6, 7, 8], 30
    sp = internal_pb2.SamplingParams(temperature=0, top_p=1, repetition_penalty=1, max_tokens=max_tokens,
                                     ignore_eos=True)
    raw = internal_pb2.DecodeRequest(request_id=rid, epoch=d.epoch, prompt_ids=ids, first_token_id=9,
                                     sampling=sp, kv_wait_s=1).SerializeToString()
    t1, out1 = start(dec, raw)
    time.sleep(0.1)
    msgs = kv_messages(fp, kv_tensor(fp, len(ids), "normal", 0), rid=rid, worker_id=d.config.worker_id,
                       epoch=d.epoch, chunk_bytes=1 << 20)
    assert push(channels, [m.SerializeToString() for m in msgs]).code == "OK"
    time.sleep(0.2)
    t2, out2 = start(dec, raw)
    t1.join()
    t2.join()
    INPUTS["concurrent"] += 2
    judge(out2[0], Verdict({"ABORTED"}, ("already running",)), WORKER_CODES | {"ABORTED"}, raw)
    assert out1[0].code == "OK", out1
    assert len([t for e in out1[0].responses for t in e.token_ids]) == max_tokens - 1

    # Prefill: the second arrives while the first is still in the engine (a prompt of 600 tokens).
    rid, prompt_ids = unique_id("dup-p"), list(range(10, 610))
    target = internal_pb2.KVTarget(worker_id=d.config.worker_id, kv_address=d.kv_address, epoch=d.epoch)
    raw = internal_pb2.PrefillRequest(request_id=rid, prompt_ids=prompt_ids, sampling=sp,
                                      target=target).SerializeToString()
    t1, out1 = start(pre, raw)
    time.sleep(0.1)
    t2, out2 = start(pre, raw)
    t1.join()
    t2.join()
    INPUTS["concurrent"] += 2
    judge(out2[0], Verdict({"ABORTED"}, ("already running",)), WORKER_CODES | {"ABORTED"}, raw)
    assert out1[0].code == "OK", out1
    claim_kv(channels, cluster, rid, prompt_ids, out1[0].responses[0].first_token.token_id)


def test_retried_decode_after_a_cancelled_one(cluster, channels, baseline):
    """The router's next attempt after a prefill failure: the first Decode was cancelled before any KV
    came, and the retry (same request id, same decode worker) must get its KV, not a refusal."""
    d = cluster.decode[0]
    fp = d.fingerprint()
    dec = raw_method(channels["decode"], "/handoff.v1.DecodeWorker/Decode", internal_pb2.DecodeEvent)
    sp = internal_pb2.SamplingParams(temperature=0, top_p=1, repetition_penalty=1, max_tokens=3, ignore_eos=True)
    rid, ids = unique_id("retry"), [5, 6, 7, 8]
    raw = internal_pb2.DecodeRequest(request_id=rid, epoch=d.epoch, prompt_ids=ids, first_token_id=9,
                                     sampling=sp, kv_wait_s=5).SerializeToString()
    first = dec(raw, timeout=CALL_TIMEOUT_S)
    time.sleep(0.2)
    first.cancel()
    time.sleep(0.3)  # the worker notices the cancellation
    outs: list[Outcome] = []
    retry = threading.Thread(target=lambda: outs.append(call_stream(dec, raw, CALL_TIMEOUT_S)))
    retry.start()
    time.sleep(0.1)
    msgs = kv_messages(fp, kv_tensor(fp, len(ids), "normal", 0), rid=rid, worker_id=d.config.worker_id,
                       epoch=d.epoch, chunk_bytes=1 << 20)
    pushed = push(channels, [m.SerializeToString() for m in msgs])
    retry.join()
    INPUTS["concurrent"] += 3
    assert pushed.code == "OK", pushed
    assert outs[0].code == "OK", outs


# --------------------------------------------------------------------------- 3. afterwards

def wait_idle(cluster, timeout_s: float = 15.0) -> None:
    """Every pool all-free and consistent, and no lease left in Redis."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            cluster.check_integrity()
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


def test_cluster_survives_fuzzing(cluster, channels, baseline):
    wait_idle(cluster)
    for w in cluster.decode + cluster.prefill:
        assert w.engine._thread.is_alive(), f"{w.config.worker_id}: engine thread died"
        assert w.registration._thread.is_alive(), f"{w.config.worker_id}: heartbeat thread died"
        ch = grpc.insecure_channel(f"127.0.0.1:{w.config.port}")
        try:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
        finally:
            ch.close()
        assert status == health_pb2.HealthCheckResponse.SERVING, w.config.worker_id
    # Greedy output is exactly what it was before the fuzzing (no poisoned KV blocks, no state left over).
    assert greedy(channels) == baseline
    wait_idle(cluster)
    # Every accepted request reached exactly one terminal state.
    for rid in ACCEPTED_RIDS:
        record = cluster.state.get_request(rid)
        assert record is not None and record["state"] in TERMINAL_STATES, (rid, record)
    # The prefill worker was told to push to many addresses: it must not keep a channel open to each.
    p = cluster.prefill[0]
    assert len(p.kv_channels._channels) <= p.kv_channels.max_idle, sorted(p.kv_channels._channels)
    total = sum(INPUTS.values())
    print(f"\nfuzzed inputs: {total} ({dict(INPUTS)}); statuses: {dict(OUTCOMES)}")
    assert total >= 1000, f"only {total} inputs were fuzzed (run the whole module): {dict(INPUTS)}"
