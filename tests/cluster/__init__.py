"""Tests of whole clusters in process: router, prefill and decode workers, Redis (TLS included)."""
