"""The fuzzing cluster (one per package run) and its channels, and the greedy baseline answer."""
from __future__ import annotations

import grpc
import pytest

from router.cluster import Cluster
from router.config import RouterConfig
from tests.fuzz.protowire import DEFAULT_MAX_TOKENS, greedy


@pytest.fixture(scope="package")
def cluster():
    c = Cluster(num_prefill=1, num_decode=1, dtype="fp32", kv_memory_gib=0.05, threads=1,
                router=RouterConfig(default_max_tokens=DEFAULT_MAX_TOKENS)).start()
    yield c
    c.stop(drain_timeout_s=2)


@pytest.fixture(scope="package")
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


@pytest.fixture(scope="package")
def baseline(cluster, channels):
    """The greedy answer before any fuzzing; the cluster must give exactly this one afterwards."""
    return greedy(channels)
