"""kill -9 of a decode worker mid-stream, once per model family, in the file type people download
(Q4_K_M) and the default dtype: every stream, greedy and seeded, completes with the fault-free tokens
on the other decode worker, and nothing is left held (invariants 1, 2 and 4: one terminal state, every
KV block freed, same inputs, same tokens). One prefill worker, two decode workers, real processes."""
from __future__ import annotations

import dataclasses

import pytest

from tests.support.faults import SPECS, fault_free, kill_mid_stream
from tests.support.proc_cluster import ProcCluster
from bench.zoo import ARCHS
from tests.support.zoo import family_files  # noqa: F401 (a fixture)

pytestmark = pytest.mark.faults

# The zoo's models are a few MB: a stream's 32 tokens can all be out before a kill lands (seen once in CI: no
# stream failed over), so these streams are long enough to be cut whatever the host's speed.
LONG = [dataclasses.replace(s, max_tokens=192) for s in SPECS]


@pytest.mark.parametrize("arch", ARCHS)
def test_kill_a_decode_worker_mid_stream(arch, tmp_path, family_files):  # noqa: F811
    model = family_files(arch)["Q4_K_M"]
    procs = ProcCluster(tmp_path, num_prefill=1, num_decode=2, model=str(model)).start()
    try:
        kill_mid_stream(procs, fault_free(procs, LONG), "decode-0", f"{arch} Q4_K_M, 1 prefill + 2 decode", LONG)
    finally:
        procs.stop()
