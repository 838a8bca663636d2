"""The kills of tests/faults/test_faults.py when decode workers prefill prompts themselves, on real processes in
the default configuration, greedy and seeded sampled requests:

- colocated (no prefill worker, two decode workers): a killed decode worker's streams resume on the other
  one, which prefills the prompt and replays the completion, with exactly the fault-free tokens;
- conditional (one prefill worker, two decode workers): long prompts go to the prefill worker; when it
  is killed with prompts queued, they are prefilled on the decode workers instead, same tokens.
"""
from __future__ import annotations

import time
from dataclasses import replace

import pytest

from tests.support.faults import SPECS, assert_terminal, fault_free, join, kill_mid_stream, report, run_many, \
    settle_and_measure
from tests.support.proc_cluster import ProcCluster

pytestmark = [pytest.mark.faults, pytest.mark.timeout(900)]

MIN_REMOTE_TOKENS = 64  # conditional: SPECS' prompts stay local, the long ones below go remote


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    c = ProcCluster(tmp_path_factory.mktemp("coloc"), num_prefill=0, num_decode=2,
                    env={"HANDOFF_PREFILL_MODE": "colocated", "HANDOFF_DENSE_WEIGHTS": "keep"}).start()
    yield c
    c.stop()


@pytest.mark.parametrize("victim", ["decode-0"])  # decode-1 is its mirror image (and the suite's time is short)
def test_kill_decode_worker_colocated(colocated, victim):
    kill_mid_stream(colocated, fault_free(colocated), victim, "0P+2D colocated")
    records = [colocated.state.get_request(rid) for rid in colocated.state.recent_request_ids(limit=500)[0]]
    assert records and all(r["prefill_placement"] == "local" for r in records)


def test_kill_prefill_worker_conditional_falls_back_to_decode(tmp_path):
    # 12 prompts of 214 tokens (prompt + max_tokens) at once: 168 blocks, which two 0.05 GiB pools hold in
    # bf16 but not in fp32 (46 KB a token: 72 blocks each), the dtype auto picks on hosts without native
    # bf16; the test is about the fallback, not about queueing for KV.
    procs = ProcCluster(tmp_path, num_prefill=1, num_decode=2, kv_memory_gib=0.1,
                        env={"HANDOFF_PREFILL_MODE": "conditional", "HANDOFF_DENSE_WEIGHTS": "keep",
                             "HANDOFF_REMOTE_PREFILL_MIN_TOKENS": str(MIN_REMOTE_TOKENS),
                             # length alone: every long prompt queues on prefill-0, so the ones moved
                             # to a decode worker are moved by the fallback, not by the queue rule
                             "HANDOFF_REMOTE_PREFILL_MAX_QUEUE_RATIO": "0"}).start()
    try:
        words = " and then it walked on" * 40
        specs = [replace(s, prompt=s.prompt + words, max_tokens=8) for s in SPECS]
        ref = fault_free(procs, specs)
        threads, results = run_many(procs.router_address, specs, "kill-prefill-conditional")
        time.sleep(0.5)
        t_kill = procs.kill("prefill-0")
        join(threads)
        left = settle_and_measure(procs)
        assert_terminal(procs, results)
        records = {r.rid: procs.state.get_request(r.rid) for r in results}
        moved = [r for r in results if records[r.rid]["prefill_placement"] == "local"]
        for kind in ("greedy", "sampled"):
            mine = [r for r in results if r.spec.kind == kind]
            report(fault="kill -9 prefill-0 with prompts queued", topology="1P+2D conditional", kind=kind,
                   streams=len(mine), completed=sum(r.completed for r in mine),
                   identical=sum(r.ids == ref[r.spec.name] for r in mine),
                   prefilled_on_decode=sum(r in moved for r in mine),
                   all_done_after_s=round(max(r.times[-1] for r in mine) - t_kill, 3),
                   leaked_blocks=left["blocks_used"], leases_left=left["leases"])
        for r in results:
            assert r.completed, (r.rid, r.error)
            assert r.ids == ref[r.spec.name], r.rid
        assert moved, "no prompt was left on the killed prefill worker to move"
        assert not any(left.values()), left
    finally:
        procs.stop()
