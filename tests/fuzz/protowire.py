"""Property-based fuzzing of every RPC a client or a peer can reach (invariants 1, 2 and 5: one terminal state, every KV block freed, no input crashes a service).

Requests are built as raw protobuf bytes, not through the generated classes, so the servers also see
what those classes refuse to write: invalid UTF-8 in string fields (lone surrogates), unknown and
mistyped fields, truncated or garbage messages, out-of-range varints and any float bit pattern. Each
input's expected outcome comes from an oracle written against the proto contract (handoff.proto,
internal.proto): the bytes are parsed locally and checked field by field, so a request the contract
rejects must get INVALID_ARGUMENT naming the field, a valid one must be served, and nothing may end
in UNKNOWN, INTERNAL or a hang. Work on a decode worker needs a live lease in Redis: the tests
reserve as the router would (near-valid requests now and then get none, or one block too few, and
must then see FAILED_PRECONDITION), release afterwards, and claim every KV push that was accepted.
After all the fuzzing the cluster must still serve a greedy request exactly as before, with every
KV block free, no KV parked, no lease left in Redis and every worker thread alive.

Runs as one package (the last test checks the totals): about 1,350 inputs, 2-2.5 minutes on a
2-core machine, most of it Router.Generate.

This module holds the shared parts: the protobuf wire encoding, value strategies, the oracle and the judge; tests/fuzz/test_*.py hold one RPC each.
"""
from __future__ import annotations

import collections
import math
import struct
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable

import grpc
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from common import grpc_common
from common.engine.output import OutputProcessor
from common.kv_wire import LAYOUT
from common.pb_convert import sampling_from_pb
from protos import handoff_pb2, internal_pb2

MAX_SEED = 2**63 - 1


MAX_PUBLIC_MESSAGE_BYTES = 4 << 20  # the router's receive limit (common.grpc_common)


MAX_INTERNAL_MESSAGE_BYTES = 8 << 20  # the workers' receive limit


DEFAULT_MAX_TOKENS = 3  # the fuzz cluster's router default, so requests without max_tokens stay quick


CALL_TIMEOUT_S = 30.0  # every call must end well within this; DEADLINE_EXCEEDED here means a hang


# Codes a client may see from the router, and a peer from a worker (never UNKNOWN or INTERNAL).
ROUTER_CODES = {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "ALREADY_EXISTS", "UNAVAILABLE"}


WORKER_CODES = {"OK", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "DATA_LOSS", "UNAVAILABLE", "CANCELLED",
                "RESOURCE_EXHAUSTED"}


FUZZ = settings(deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example, HealthCheck.filter_too_much])


INPUTS: collections.Counter[str] = collections.Counter()  # inputs sent, per test


OUTCOMES: collections.Counter[str] = collections.Counter()  # "rpc status" -> inputs


_ids = iter(range(10**9))


def unique_id(prefix: str) -> str:
    return f"{prefix}-{time.monotonic_ns()}-{next(_ids)}"


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
            fields = [f_len(2, m) for m in msgs]
            # Many messages, or past the 4 MiB limit, but never gigabytes in the test process: 1,000 copies
            # of a 4 MB message were 17 GB, and the kernel killed the whole test run.
            size = max(1, sum(map(len, fields)))
            repeat = min(draw(st.sampled_from([1, 1, 1, 60, 257, 1000])), max(1, 2 * MAX_PUBLIC_MESSAGE_BYTES // size))
            parts += fields * repeat
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


POOL_TOO_SMALL = "needs more KV than the whole pool"  # refused after its record was made: its id is used


@dataclass
class Verdict:
    """What the contract allows for one input."""

    codes: set[str]
    hints: tuple[str, ...] = ()  # the details of a hint_code status must name one of these
    why: str = ""
    request: object = None
    prompt_len: int = 0
    max_tokens: int = 0
    hint_code: str = "INVALID_ARGUMENT"


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
    logprobs = s.DESCRIPTOR.fields_by_name.get("logprobs")
    if logprobs is not None and logprobs.type == logprobs.TYPE_UINT32 and has("logprobs"):
        check("logprobs", s.logprobs <= 20)  # internal: alternatives per token, 0-20 (public: a bool)
    if "top_logprobs" in s.DESCRIPTOR.fields_by_name and has("top_logprobs"):
        # public: "Range 0 to 20; needs logprobs": present, even as 0, it asks for logprobs (as vLLM reads it)
        check("top_logprobs", 0 <= s.top_logprobs <= 20 and s.logprobs)
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
    # "Non-empty when used": a prompt of characters the vocabulary has no byte tokens for (SmolLM2 has
    # none for bytes 0x04, 0x06, 0x13, 0x14, 0x16, 0x1d, as in its HF tokenizer) is empty once tokenized.
    # Each distinct character yields a token wherever it stands or none at all, so the distinct ones
    # tell (a 4 MB prompt need not be tokenized to know).
    no_tokens = bool(r.prompt) and not r.messages and not tok.encode("".join(set(r.prompt)))
    if r.HasField("max_tokens") and r.max_tokens < 1:
        bad.append("max_tokens")
    bad += sampling_violations(r, model.vocab_size)
    if bad:
        # The router may report a too long prompt or max_tokens first, which only tokenizing would tell.
        hints = (*bad, *loose, "context", *(["max_tokens"] if r.HasField("max_tokens") and r.max_tokens > 1 else []),
                 *(["prompt"] if no_tokens else []))
        return Verdict({"INVALID_ARGUMENT"}, hints, "violates " + ", ".join(bad), r)
    if no_tokens:
        return Verdict({"INVALID_ARGUMENT"}, ("prompt", *loose), "a prompt that encodes to no tokens", r)
    try:
        text = r.prompt or tok.apply_chat_template([{"role": m.role, "content": m.content} for m in r.messages])
        prompt_len = len(tok.encode(text))
    except ValueError:  # the chat template refused: INVALID_ARGUMENT is right
        return Verdict({"INVALID_ARGUMENT"}, ("messages", "role"), "chat template refuses", r)
    # Past here a refusal may name the context, or any loose field: the router checks those first.
    room = model.max_position - prompt_len
    max_tokens = r.max_tokens if r.HasField("max_tokens") else min(DEFAULT_MAX_TOKENS, room)
    if room < 1:
        return Verdict({"INVALID_ARGUMENT"}, ("context", *loose), f"prompt of {prompt_len} tokens fills the context",
                       r)
    if max_tokens > room:
        return Verdict({"INVALID_ARGUMENT"}, ("max_tokens", *loose), "max_tokens past the context", r)
    pool = cluster.decode[0].engine.pool
    # More KV than the whole pool can never be served: a bad max_tokens (400), not a full cluster.
    too_big = pool.blocks_for(prompt_len + max_tokens) > pool.num_blocks
    codes = {"INVALID_ARGUMENT"} if too_big else {"OK"}
    hints = ("max_tokens", *loose) if too_big else tuple(loose)
    if r.request_id and r.request_id in used_rids:
        codes = {"ALREADY_EXISTS"}
    if loose:
        codes.add("INVALID_ARGUMENT")
    why = POOL_TOO_SMALL if too_big else "valid" if not loose else f"valid by the letter of {loose}"
    return Verdict(codes, hints, why, r, prompt_len, max_tokens)


@dataclass
class Outcome:
    code: str
    details: str
    responses: list
    elapsed_s: float
    blame: tuple[str, str, str] | None = None  # (role, worker_id, epoch) from handoff-failed-* trailers


def call_stream(method, request, timeout: float, on_message=None) -> Outcome:
    """The whole stream of one call; on_message(msg), if given, sees each message as it arrives."""
    t0 = time.monotonic()
    responses = []
    try:
        for msg in method(request, timeout=timeout):
            responses.append(msg)
            if on_message is not None:
                on_message(msg)
        return Outcome("OK", "", responses, time.monotonic() - t0)
    except grpc.RpcError as exc:
        return Outcome(exc.code().name, exc.details() or "", responses, time.monotonic() - t0,
                       grpc_common.blamed(exc))


def call_unary(method, request, timeout: float) -> Outcome:
    t0 = time.monotonic()
    try:
        return Outcome("OK", "", [method(request, timeout=timeout)], time.monotonic() - t0)
    except grpc.RpcError as exc:
        return Outcome(exc.code().name, exc.details() or "", [], time.monotonic() - t0, grpc_common.blamed(exc))


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
    if out.code == verdict.hint_code and verdict.hints:
        assert any(h in out.details for h in verdict.hints), f"{out.code} does not say which field or why" + where


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


ACCEPTED_RIDS: list[str] = []


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


def id_violations(ids, vocab_size: int, max_len: int, name: str) -> list[str]:
    ids = list(ids)
    return [name] if not ids or len(ids) > max_len or any(not 0 <= t < vocab_size for t in ids) else []


LEASE_TTL_S = 60.0  # longer than any test holds one; each is released as soon as its calls end


def reserve(cluster, rid: str, num_tokens: int = 0, *, num_blocks: int = 0) -> int:
    """Lease the decode worker's KV blocks to rid, as the router does before a Prefill or Decode:
    enough for num_tokens, or exactly num_blocks. Replaces rid's lease if it has one."""
    d = cluster.decode[0]
    num_blocks = num_blocks or d.engine.pool.blocks_for(num_tokens)
    got = cluster.state.reserve(d.config.worker_id, d.epoch, rid, num_blocks, LEASE_TTL_S)
    assert got.ok, f"reserving {num_blocks} blocks for {rid!r}: {got}"
    return num_blocks


def release(cluster, rid: str) -> None:
    cluster.state.release(cluster.decode[0].config.worker_id, rid)


def claim_kv(channels, cluster, rid: str, prompt_ids: list[int], output_ids: list[int], attempt: int) -> None:
    """Take a pushed KV off the decode worker: a Decode of one more token (its replay feeds the pushed
    KV through the model), under a lease that is released afterwards."""
    reserve(cluster, rid, len(prompt_ids) + len(output_ids) + 1)
    req = internal_pb2.DecodeRequest(
        request_id=rid, epoch=cluster.decode[0].epoch, prompt_ids=prompt_ids, output_ids=output_ids,
        attempt=attempt, kv_wait_s=5,
        sampling=internal_pb2.SamplingParams(temperature=0, top_p=1, repetition_penalty=1,
                                             max_tokens=len(output_ids) + 1, ignore_eos=True))
    try:
        out = call_stream(raw_method(channels["decode"], "/handoff.v1.DecodeWorker/Decode", internal_pb2.DecodeEvent),
                          req.SerializeToString(), CALL_TIMEOUT_S)
    finally:
        release(cluster, rid)
    assert out.code == "OK", f"claiming the KV of {rid!r} (attempt {attempt}): {out.code} {out.details}"
    assert [len(e.token_ids) for e in out.responses] == [1], out.responses
    assert out.responses[-1].finish_reason == handoff_pb2.FINISH_REASON_LENGTH


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
                attempt: int = 0, reservation_id: str = "") -> list[internal_pb2.KVChunk]:
    """A well-formed push, as messages (not a lazy iterator) so a test can tamper with them."""
    payload = kv.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    num_chunks = -(-len(payload) // chunk_bytes)
    msgs = [internal_pb2.KVChunk(header=internal_pb2.KVHeader(
        request_id=rid, target_worker_id=worker_id, target_epoch=epoch, fingerprint=fp.to_pb(),
        num_tokens=kv.shape[2], total_bytes=len(payload), num_chunks=num_chunks, layout=LAYOUT,
        reservation_id=reservation_id, attempt=attempt))]
    for i in range(num_chunks):
        piece = payload[i * chunk_bytes:(i + 1) * chunk_bytes]
        msgs.append(internal_pb2.KVChunk(data=internal_pb2.KVData(index=i, offset=i * chunk_bytes, payload=piece,
                                                                   crc32=zlib.crc32(piece))))
    return msgs


def push(channels, messages: list[bytes], timeout: float = CALL_TIMEOUT_S) -> Outcome:
    method = raw_method(channels["kv"], "/handoff.v1.KVTransfer/PushKV", internal_pb2.PushKVReply, "stream_unary")
    return call_unary(method, iter(messages), timeout)


def push_kv(channels, cluster, rid: str, kv: torch.Tensor, attempt: int, chunk_bytes: int = 1 << 20) -> Outcome:
    """A well-formed push of kv for (rid, attempt) to the decode worker; the lease is the caller's."""
    d = cluster.decode[0]
    msgs = kv_messages(d.fingerprint(), kv, rid=rid, worker_id=d.config.worker_id, epoch=d.epoch,
                       chunk_bytes=chunk_bytes, attempt=attempt)
    return push(channels, [m.SerializeToString() for m in msgs])


# The router numbers attempts 1, 2, ...; the field is a uint32 (a wider varint keeps its low 32 bits).
SANE_ATTEMPT = st.integers(0, 5)


WILD_ATTEMPT = st.one_of(st.none(), ANY_VARINT, st.sampled_from([0, 2**32 - 1, 2**32, 2**32 + 1]))


def attempt_part(number: int, attempt) -> list[bytes]:
    return [] if attempt is None else [f_varint(number, attempt)]


LEASES = st.sampled_from(["full"] * 6 + ["none", "small"])  # what a near-valid request was reserved


def completion_ends(cluster, sampling: internal_pb2.SamplingParams, prompt_len: int, output_ids) -> bool:
    """Whether output_ids already end the completion (a stop id or string, max_tokens, the context):
    what the router's OutputProcessor decides for the same tokens, the one judge of where a stream ends."""
    d = cluster.decode[0]
    params, _ = sampling_from_pb(sampling, d.model.config.vocab_size)
    out = OutputProcessor(d.tokenizer, params, prompt_len, d.model.config.max_position)
    for t in output_ids:
        out.push(t)
        if out.finish_reason is not None:
            return True
    return False


def assert_nothing_parked(cluster, timeout_s: float = 5.0) -> None:
    """No KV waits in the decode worker for a Decode call: every test claims or refuses what it pushes.
    (A refused or cancelled claim frees its KV on the engine thread, a moment later.)"""
    d = cluster.decode[0]
    deadline = time.monotonic() + timeout_s
    while d.engine.num_parked or d.inbox.num_parked:
        assert time.monotonic() < deadline, (f"KV left parked: {d.engine.num_parked} in the engine, "
                                             f"{d.inbox.num_parked} in the inbox")
        time.sleep(0.01)
