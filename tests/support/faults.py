"""What the fault suites share: the requests they stream (greedy and seeded sampled), running them
concurrently, killing a process mid-stream and measuring what the clients saw."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import grpc

from common.state import TERMINAL_STATES
from protos import handoff_pb2, handoff_pb2_grpc
from tests.support.proc_cluster import ProcCluster

MAX_TOKENS = 32
ANIMALS = ["cat", "dog", "fox", "owl", "bee", "cow"]
SETTLE_S = 1.5  # three heartbeats: the registry shows what the workers hold once their streams ended


@dataclass(frozen=True)
class Spec:
    """One request of a fault scenario: greedy, or sampled with a fixed seed."""

    name: str
    prompt: str
    kind: str  # "greedy" | "sampled"
    max_tokens: int = MAX_TOKENS
    stop_token_ids: tuple[int, ...] = ()
    # A JSON schema the completion is constrained to (structured output): it then ends where the schema is met,
    # with EOS, rather than running to max_tokens.
    json_schema: str = ""

    def request(self, rid: str) -> handoff_pb2.GenerateRequest:
        sampling = (dict(temperature=0.0) if self.kind == "greedy" else
                    dict(temperature=1.0, top_p=0.95, seed=1000 + ANIMALS.index(self.name.split("-")[-1])))
        if self.json_schema:
            sampling["structured_output"] = handoff_pb2.StructuredOutput(json_schema=self.json_schema)
        return handoff_pb2.GenerateRequest(prompt=self.prompt, max_tokens=self.max_tokens,
                                           ignore_eos=not self.json_schema, request_id=rid,
                                           stop_token_ids=list(self.stop_token_ids), **sampling)


SPECS = [Spec(f"{kind}-{a}", f"The story of a {a} who", kind) for kind in ("greedy", "sampled") for a in ANIMALS]


@dataclass
class Outcome:
    spec: Spec
    rid: str
    ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # monotonic arrival of each message
    finish: int | None = None
    error: tuple | None = None

    @property
    def completed(self) -> bool:
        return self.error is None and self.finish is not None


def run_one(address: str, spec: Spec, rid: str, *, timeout: float = 120, cancel_after_s: float | None = None,
            progress: dict | None = None) -> Outcome:
    out = Outcome(spec, rid)
    with grpc.insecure_channel(address) as ch:
        call = handoff_pb2_grpc.RouterStub(ch).Generate(spec.request(rid), timeout=timeout)
        timer = threading.Timer(cancel_after_s, call.cancel) if cancel_after_s is not None else None
        if timer:
            timer.start()
        try:
            for msg in call:
                out.ids += msg.token_ids
                out.times.append(time.monotonic())
                if progress is not None:
                    progress[rid] = len(out.ids)
                if msg.finish_reason:
                    out.finish = msg.finish_reason
        except grpc.RpcError as exc:
            out.error = (exc.code(), exc.details())
        finally:
            if timer:
                timer.cancel()
    return out


def run_many(address: str, specs: list[Spec], tag: str, **kw) -> tuple[list[threading.Thread], list[Outcome]]:
    results: list[Outcome] = [None] * len(specs)  # type: ignore[list-item]

    def work(i: int, spec: Spec) -> None:
        results[i] = run_one(address, spec, f"{tag}-{spec.name}-{time.monotonic_ns()}", **kw)

    threads = [threading.Thread(target=work, args=(i, s)) for i, s in enumerate(specs)]
    for t in threads:
        t.start()
    return threads, results


def join(threads: list[threading.Thread], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = sum(t.is_alive() for t in threads)
    assert not hung, f"{hung} client streams still open after {timeout_s} s: a request hangs"


def fault_free(procs: ProcCluster, specs: list[Spec] = SPECS) -> dict[str, list[int]]:
    """The fault-free outputs: the same requests, run concurrently as in the scenarios."""
    threads, results = run_many(procs.router_address, specs, "ref")
    join(threads)
    for r in results:
        assert r.completed and len(r.ids) == r.spec.max_tokens, (r.rid, r.error)
    return {r.spec.name: r.ids for r in results}


def wait_streaming(progress: dict, count: int, min_tokens: int, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(1 for n in progress.values() if n >= min_tokens) < count:
        assert time.monotonic() < deadline, f"streams did not get going: {progress}"
        time.sleep(0.02)


def longest_stall(outcomes: list[Outcome], since: float) -> float:
    """The longest wait for a next token, in any stream, across `since` (the fault)."""
    gaps = [b - a for r in outcomes for a, b in zip(r.times, r.times[1:]) if b > since]
    return max(gaps, default=0.0)


def assert_terminal(procs: ProcCluster, outcomes: list[Outcome]) -> None:
    for r in outcomes:
        record = procs.state.get_request(r.rid)
        assert record is not None, f"{r.rid}: no record"
        assert record["state"] in TERMINAL_STATES, f"{r.rid}: record stuck in {record['state']}"


def settle_and_measure(procs: ProcCluster, max_wait_s: float = 10.0) -> dict[str, int]:
    """What the workers still hold once settled: SETTLE_S after the last stream ended, and then until
    nothing is held or max_wait_s more have passed (a loaded machine takes a while to process the
    last cancels; a leak stays). Every figure must be 0."""
    time.sleep(SETTLE_S)
    deadline = time.monotonic() + max_wait_s
    while any((left := procs.leftovers()).values()) and time.monotonic() < deadline:
        time.sleep(0.25)
    return left


def report(**figures) -> None:
    print(json.dumps(figures), flush=True)


def wait_streaming_on(procs: ProcCluster, progress: dict, worker_id: str, min_tokens: int,
                      timeout_s: float = 90, max_tokens: int = MAX_TOKENS) -> None:
    """Until a stream that decodes on worker_id has min_tokens and at least as many still to come. Waiting
    for every stream to have started is not enough: on a fast host the first streams finish before the last
    ones start, and a kill then cuts no stream at all."""
    deadline = time.monotonic() + timeout_s
    while not any(min_tokens <= progress.get(rid, 0) <= max_tokens - min_tokens
                  for rid in procs.state.reservations(worker_id)):
        assert time.monotonic() < deadline, f"no stream got going on {worker_id}: {progress}"
        time.sleep(0.005)


def kill_mid_stream(procs: ProcCluster, reference: dict[str, list[int]], victim: str, topology: str,
                    specs: list[Spec] = SPECS) -> None:
    """kill -9 `victim` while streams are producing tokens (on it, for a decode worker); then every stream
    completes with the fault-free tokens, and nothing is left held. One report line per request kind.
    specs: the requests (longer ones for a model small enough to finish 32 tokens before a kill lands)."""
    progress: dict[str, int] = {}
    threads, results = run_many(procs.router_address, specs, f"kill-{victim}", progress=progress)
    if victim.startswith("decode"):
        wait_streaming_on(procs, progress, victim, 4, max_tokens=min(s.max_tokens for s in specs))
    else:
        wait_streaming(progress, len(specs), 4)
    t_kill = procs.kill(victim)
    join(threads)
    procs.restart(victim)
    left = settle_and_measure(procs)
    assert_terminal(procs, results)
    moved = sum(int(procs.state.get_request(r.rid).get("attempt", 1)) > 1 for r in results)
    for kind in ("greedy", "sampled"):
        mine = [r for r in results if r.spec.kind == kind]
        report(fault=f"kill -9 {victim}", topology=topology, kind=kind, streams=len(mine),
               completed=sum(r.completed for r in mine),
               identical=sum(r.completed and r.ids == reference[r.spec.name] for r in mine),
               failed_over=sum(int(procs.state.get_request(r.rid).get("attempt", 1)) > 1 for r in mine),
               longest_stall_s=round(longest_stall(mine, t_kill), 3),
               leaked_blocks=left["blocks_used"], parked_or_running=left["sequences"], leases_left=left["leases"])
    for r in results:
        assert r.completed, f"{r.rid}: {r.error}"
        assert r.ids == reference[r.spec.name], f"{r.rid} ({r.spec.kind}) differs from the fault-free run"
    assert not any(left.values()), left
    if victim.startswith("decode"):
        assert moved, "no request was failed over: did the kill land on a worker with streams?"
