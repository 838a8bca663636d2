"""Tests of the engine alone: model numerics against HF, weights, tokenizers, scheduling, the KV pool, sampling (no service)."""
