"""The machine's memory-read bandwidth, and the decode speed it allows (the roofline of a small batch).

A decode step at batch 1 reads every weight once and does almost no arithmetic with each byte,
so `bandwidth / bytes read per step` is the fastest it can go on this machine.
"""
from __future__ import annotations

import time

import torch

_ROW_BYTES = 1 << 18  # 256 KiB rows: long enough to stream, enough of them to split across threads


def read_bandwidth_gbs(num_bytes: int = 1 << 30, repeats: int = 8) -> float:
    """Best-of-`repeats` GB/s (1e9 bytes/s) of summing a `num_bytes` fp32 tensor, at torch's thread count.

    A 2-D row sum, not a flat sum: torch splits rows across threads and vectorises each, where a flat
    1-D sum of the same bytes ran at a third of the speed here. Best, not median: the question is what
    the memory can deliver, and other processes only ever make a pass slower.
    """
    cols = _ROW_BYTES // 4
    rows = max(1, num_bytes // _ROW_BYTES)
    x = torch.ones(rows, cols, dtype=torch.float32)  # written once, so every page is really mapped
    nbytes = x.numel() * x.element_size()
    best_s = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum(dim=1)
        best_s = min(best_s, time.perf_counter() - t0)
    return nbytes / best_s / 1e9


def decode_bound_tok_s(bandwidth_gbs: float, weight_bytes: int, batch: int = 1) -> float:
    """Tokens/s if a step of `batch` sequences cost only reading `weight_bytes` once at `bandwidth_gbs`."""
    return batch * bandwidth_gbs * 1e9 / weight_bytes
