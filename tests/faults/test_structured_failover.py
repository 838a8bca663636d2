"""kill -9 of a decode worker in the middle of constrained (structured output) streams: each resumes on the other
decode worker, which re-prefills the prompt and replays the tokens already streamed through the constraint's
matcher, and ends with exactly the tokens of the fault-free run, greedy and seeded, valid against the schema; every
request reaches a terminal state and nothing is left held. Dynamo's request migration leaves guided decoding out;
here it is the same path as free text. One prefill worker, two decode workers, real processes."""
from __future__ import annotations

import json
import time

import jsonschema
import pytest

from common.engine.model_files import resolve_model_path
from common.engine.tokenizer import load_tokenizer
from tests.support.faults import Spec, assert_terminal, join, report, run_many, settle_and_measure
from tests.support.proc_cluster import ProcCluster

pytestmark = [pytest.mark.faults, pytest.mark.timeout(600)]

# Long enough (a list of 6 animals, ~70 tokens) that a kill lands mid-stream, bounded so that it always completes.
ANIMAL = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
          "required": ["name", "legs"], "additionalProperties": False}
SCHEMA = {"type": "array", "items": ANIMAL, "minItems": 6, "maxItems": 6}
# In this order, a router that spreads streams over the two decode workers in turn gives each both kinds.
SPECS = [Spec(f"{kind}-{a}", f"A list of animals, as JSON, starting with the {a}:", kind, max_tokens=160,
              json_schema=json.dumps(SCHEMA))
         for kind, a in [("greedy", "cat"), ("greedy", "dog"), ("sampled", "cat"), ("sampled", "dog"),
                         ("greedy", "fox"), ("sampled", "fox")]]


def test_kill_decode_worker_mid_constrained_stream(tmp_path):
    tokenizer = load_tokenizer(resolve_model_path("smollm2"))
    procs = ProcCluster(tmp_path, num_prefill=1, num_decode=2).start()
    try:
        threads, reference = run_many(procs.router_address, SPECS, "ref")
        join(threads)
        for r in reference:
            assert r.completed, (r.rid, r.error)
            jsonschema.validate(json.loads(tokenizer.decode(r.ids)), SCHEMA)
        expected = {r.spec.name: r.ids for r in reference}
        progress: dict[str, int] = {}
        threads, results = run_many(procs.router_address, SPECS, "kill", progress=progress)
        victim = wait_for_both_kinds_mid_stream(procs, progress, min(len(ids) for ids in expected.values()))
        procs.kill(victim)
        join(threads)
        procs.restart(victim)
        left = settle_and_measure(procs)
        assert_terminal(procs, results)
        moved = [r for r in results if int(procs.state.get_request(r.rid).get("attempt", 1)) > 1]
        for kind in ("greedy", "sampled"):
            mine = [r for r in results if r.spec.kind == kind]
            report(fault=f"kill -9 {victim}", topology="1P+2D", kind=f"{kind}, json_schema", streams=len(mine),
                   completed=sum(r.completed for r in mine),
                   identical=sum(r.completed and r.ids == expected[r.spec.name] for r in mine),
                   failed_over=sum(r in moved for r in mine), leaked_blocks=left["blocks_used"],
                   leases_left=left["leases"])
        for r in results:
            assert r.completed, f"{r.rid}: {r.error}"
            assert r.ids == expected[r.spec.name], f"{r.rid} ({r.spec.kind}) differs from the fault-free run"
            jsonschema.validate(json.loads(tokenizer.decode(r.ids)), SCHEMA)
        assert {r.spec.kind for r in moved} == {"greedy", "sampled"}, "the kill did not cut both kinds of stream"
        assert not any(left.values()), left
    finally:
        procs.stop()


def wait_for_both_kinds_mid_stream(procs: ProcCluster, progress: dict, min_len: int, timeout_s: float = 90) -> str:
    """The decode worker on which a greedy and a seeded stream both have 4 tokens and 4 more to come."""
    deadline = time.monotonic() + timeout_s
    while True:
        for name in procs.decode_names():
            kinds = {rid.split("-")[1] for rid in procs.state.reservations(name)  # "kill-<kind>-<animal>-<ns>"
                     if 4 <= progress.get(rid, 0) <= min_len - 4}
            if kinds == {"greedy", "sampled"}:
                return name
        assert time.monotonic() < deadline, f"no decode worker had both kinds mid-stream: {progress}"
        time.sleep(0.005)
