"""The machine's memory-read bandwidth, and the decode speed it allows (the roofline of a small batch).

A decode step at batch 1 reads every weight once and does almost no arithmetic with each byte,
so `bandwidth / bytes read per step` is the fastest it can go on this machine.
"""
from __future__ import annotations

import time

import torch

_ROW_BYTES = 1 << 18  # 256 KiB rows: long enough to stream, enough of them to split across threads


class ReadBandwidth:
    """Best GB/s (1e9 bytes/s) of summing an fp32 tensor at torch's thread count, over every pass so far.

    A 2-D row sum, not a flat sum: torch splits rows across threads and vectorises each, and a flat 1-D
    sum of the same bytes was much slower (docs/benchmarks.md, "Figures behind the code": A row sum for
    the bandwidth probe). Best, not median: the question is what the memory can deliver, and other
    processes only ever make a pass slower; so passes can be spread over a run (`measure` again later) to
    catch a quiet moment of a shared machine.
    """

    def __init__(self, num_bytes: int = 1 << 30):
        cols = _ROW_BYTES // 4
        rows = max(1, num_bytes // _ROW_BYTES)
        self._x = torch.ones(rows, cols, dtype=torch.float32)  # written once, so every page is mapped
        self.num_bytes = self._x.numel() * self._x.element_size()
        self.num_passes = 0
        self._best_s = float("inf")

    def measure(self, repeats: int) -> float:
        for _ in range(repeats):
            self.one_pass()
        return self.gbs

    def one_pass(self) -> float:
        """One pass; returns its seconds (and counts it towards the best)."""
        t0 = time.perf_counter()
        self._x.sum(dim=1)
        seconds = time.perf_counter() - t0
        self._best_s = min(self._best_s, seconds)
        self.num_passes += 1
        return seconds

    @property
    def gbs(self) -> float:
        return self.num_bytes / self._best_s / 1e9


def decode_bound_tok_s(bandwidth_gbs: float, weight_bytes: int, batch: int = 1) -> float:
    """Tokens/s if a step of `batch` sequences cost only reading `weight_bytes` once at `bandwidth_gbs`."""
    return batch * bandwidth_gbs * 1e9 / weight_bytes
