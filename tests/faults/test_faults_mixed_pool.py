"""A decode pool of mixed CPUs: one decode worker runs the int8 digit kernel on its AVX2 unit
(HANDOFF_NATIVE_MATMUL=avx2, what an AVX2-only node picks), the other on the widest unit this host has
(`auto`: AVX512_VNNI, AMX tiles from 13 rows, or AVX2 again), as a pool of AVX2, Zen 4 and Sapphire Rapids
nodes would. The units compute the same bits, so a request killed on one worker and failed over to the
other completes with exactly the fault-free tokens, greedy and seeded sampled, in the configuration users
run (default dtype, one prefill worker), with nothing left held."""
from __future__ import annotations

import pytest

from common.engine import native
from common.engine.native.choice import ENV_MATMUL
from tests.support.faults import fault_free, kill_mid_stream
from tests.support.proc_cluster import ProcCluster

pytestmark = [pytest.mark.faults, pytest.mark.timeout(900)]

TOPOLOGY = "1P+2D, decode-0 avx2, decode-1 auto"


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    kernels = native.kernel()
    if kernels is None or not kernels.has_avx2_digits:
        pytest.skip("this host's library has no int8 digit kernels (GCC before 11, or no AVX2): no mixed pool")
    c = ProcCluster(tmp_path_factory.mktemp("procs_mixed"), num_prefill=1, num_decode=2,
                    proc_env={"decode-0": {ENV_MATMUL: "avx2"}, "decode-1": {ENV_MATMUL: "auto"}})
    yield c.start()
    c.stop()


@pytest.fixture(scope="module")
def reference(procs):
    return fault_free(procs)


@pytest.mark.parametrize("victim", ["decode-0", "decode-1"])
def test_a_request_fails_over_between_kernel_units_with_the_same_tokens(procs, reference, victim):
    kill_mid_stream(procs, reference, victim, TOPOLOGY)
