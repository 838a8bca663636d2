"""Tests of the workers' contracts: RPCs, the KV wire format, the Redis state, protos."""
