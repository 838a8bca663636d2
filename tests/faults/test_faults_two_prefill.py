"""The kills of tests/faults/test_faults.py with two prefill workers (and two decode workers), default dtype,
greedy and seeded sampled requests: a spare prefill worker must change nothing in the outcome. Also a
prefill worker killed while it holds queued prompts: they are retried on the other one."""
from __future__ import annotations

import time
from dataclasses import replace

import pytest

from common.state import RequestState
from tests.support.faults import (
    SPECS,
    assert_terminal,
    fault_free,
    join,
    kill_mid_stream,
    report,
    run_many,
    settle_and_measure,
)
from tests.support.proc_cluster import ProcCluster

pytestmark = [pytest.mark.faults, pytest.mark.timeout(900)]

TOPOLOGY = "2P+2D"


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    c = ProcCluster(tmp_path_factory.mktemp("procs2p"), num_prefill=2, num_decode=2).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(procs):
    return fault_free(procs)


@pytest.mark.parametrize("victim", ["decode-0", "prefill-0"])
def test_kill_mid_stream(procs, reference, victim):
    kill_mid_stream(procs, reference, victim, TOPOLOGY)


def test_kill_prefill_worker_mid_batch(procs):
    """Long prompts queued on both prefill workers; one is killed: its prompts are prefilled again on
    the other and every stream gets the fault-free tokens."""
    words = " and then it walked on" * 40
    specs = [replace(s, prompt=s.prompt + words, max_tokens=8) for s in SPECS]
    ref = fault_free(procs, specs)
    threads, results = run_many(procs.router_address, specs, "kill-prefill-batch")
    time.sleep(0.5)
    t_kill = procs.kill("prefill-0")
    join(threads)
    procs.restart("prefill-0")
    left = settle_and_measure(procs)
    assert_terminal(procs, results)
    retried = [r for r in results if int(procs.state.get_request(r.rid).get("attempt", 1)) > 1]
    for kind in ("greedy", "sampled"):
        mine = [r for r in results if r.spec.kind == kind]
        report(fault="kill -9 prefill-0 with prompts queued", topology=TOPOLOGY, kind=kind, streams=len(mine),
               completed=sum(r.completed for r in mine), identical=sum(r.ids == ref[r.spec.name] for r in mine),
               retried=sum(r in retried for r in mine),
               all_done_after_s=round(max(r.times[-1] for r in mine) - t_kill, 3),
               leaked_blocks=left["blocks_used"], leases_left=left["leases"])
    for r in results:
        assert r.completed, (r.rid, r.error)
        assert r.ids == ref[r.spec.name], r.rid
    assert retried, "no prompt was on the killed prefill worker"
    assert all(any(s == RequestState.PREFILLING for s, _ in procs.state.get_request(r.rid)["history"][2:])
               for r in retried)
    assert not any(left.values()), left
