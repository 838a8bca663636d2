"""Memory for what a decode step streams, in transparent huge pages where the kernel gives them.

A one-row decode step reads ~95 MB of packed weights, and a long context's K/V on top; reading them is
most of its time. In 4 KiB pages the hardware prefetcher stops at every page boundary and every page
costs a TLB walk. In 2 MiB pages (`madvise(MADV_HUGEPAGE)`, what THP's usual `madvise` mode waits for)
the 120 layer matmuls of a step took 1.9-2.1 against 2.5-2.8 ms, and a plain read of the same 66 MB
1.6 against 2.4 ms (a C loop, 2 threads, the `avx2 avx512_bf16` VM); a one-row engine step 4.8-5.1
against 5.4 ms at the median.

Each mapping is private and anonymous, its usable range aligned to a huge page. Where THP is off
(`never`), the kernel has no THP, or HANDOFF_HUGE_PAGES=0, the same memory comes in 4 KiB pages and
nothing else changes. Tensors made here keep their mapping alive.
"""
from __future__ import annotations

import logging
import math
import mmap

import torch

from common.engine.hardware import switched_off

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ARENA_CHUNK = 32 << 20
ENV_HUGE_PAGES = "HANDOFF_HUGE_PAGES"  # 0: 4 KiB pages for the packed weights and the KV pool


def enabled() -> bool:
    return not switched_off(ENV_HUGE_PAGES)


def thp_mode() -> str:
    """The kernel's THP setting (`always`, `madvise`, `never`), or `unavailable`."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unavailable"


def _smaps() -> list[tuple[int, int, dict[str, str]]]:
    """/proc/self/smaps: every mapping's start, end and fields (`Rss`, `AnonHugePages`, `THPeligible`, ...);
    empty where there is no such file."""
    maps: list[tuple[int, int, dict[str, str]]] = []
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
                    start, end = (int(v, 16) for v in head.split("-"))
                    maps.append((start, end, {}))
                elif maps:
                    key, _, value = line.partition(":")
                    maps[-1][2][key] = value.strip()
    except OSError:
        return []
    return maps


def smaps_fields(address: int) -> dict[str, str]:
    """The smaps fields of the mapping that holds `address`; empty where there is none."""
    return next((fields for start, end, fields in _smaps() if start <= address < end), {})


def huge_page_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes in huge pages (`AnonHugePages`) of the distinct mappings holding these tensors."""
    holding = [(start, end, fields) for start, end, fields in _smaps()
               if any(start <= t.data_ptr() < end for t in tensors)]
    return sum(int(fields.get("AnonHugePages", "0 kB").split()[0]) << 10 for _, _, fields in holding)


def mapping(nbytes: int, huge: bool | None = None) -> torch.Tensor:
    """A uint8 tensor of nbytes on a fresh private anonymous mapping (zero-filled by the kernel, untouched),
    starting on a huge-page boundary and advised for huge pages unless `huge` is False (default:
    `enabled()`)."""
    huge = enabled() if huge is None else huge
    size = max(HUGE_PAGE, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
    try:
        region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:  # the kernel refused the address space (overcommit limits, a container's cap)
        raise MemoryError(f"cannot map {nbytes / 2 ** 30:.2f} GiB: {exc.strerror or exc}") from exc
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to the mapping
    skip = -whole.data_ptr() % HUGE_PAGE
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE, skip, size)  # before the first touch
        except OSError as exc:  # a kernel without THP: 4 KiB pages, as without the advice
            log.info("4 KiB pages: madvise(MADV_HUGEPAGE) failed: %s", exc)
    return whole[skip:skip + nbytes]


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU, in its own huge-page mapping, every page touched now (so that
    memory is taken at start, as torch.zeros takes it, and no step pays a page fault)."""
    nbytes = math.prod(shape) * dtype.itemsize
    t = mapping(nbytes).view(dtype).view(shape)
    t.zero_()
    return t


class WeightArena:
    """The packed decode weights, together in huge-page chunks: chunks of ARENA_CHUNK (or one weight's
    size, if larger); a weight goes into the current chunk where it fits, 64-byte aligned. A chunk's tail
    no weight uses is never touched, so it costs address space only."""

    def __init__(self, huge: bool | None = None):
        self.huge = enabled() if huge is None else huge
        self.chunks: list[torch.Tensor] = []
        self._used = 0  # bytes of the last chunk handed out

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of nbytes (zero until written), 64-byte aligned."""
        start = -(-self._used // 64) * 64
        if not self.chunks or start + nbytes > self.chunks[-1].numel():
            self.chunks.append(mapping(max(ARENA_CHUNK, nbytes), self.huge))
            start = 0
        self._used = start + nbytes
        return self.chunks[-1][start:start + nbytes]


def drop_file_pages(array) -> int:
    """Unmap from this process the resident pages of `array` where it lies in a read-only file mapping (a
    GGUF's np.memmap): what was read from the file to pack it is then no longer in this process's resident
    set, so a decode worker's memory is its packed copy, not that and the file's pages too. The pages stay
    in the kernel's page cache; a later read of the array (a lazy dense copy for a prefill) faults them back
    from there, with the same bytes. Anything not a file mapping is left as it is (on anonymous memory the
    same advice would zero it). Returns the bytes advised."""
    import ctypes

    import numpy as np

    base = array
    while base is not None and not isinstance(base, np.memmap):
        base = getattr(base, "base", None)
    region = getattr(base, "_mmap", None)
    if region is None or not hasattr(mmap, "MADV_DONTNEED"):
        return 0
    start = array.__array_interface__["data"][0]
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the array only
    last = (start + array.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if last <= first:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED) != 0:
        log.info("madvise(MADV_DONTNEED) on a file mapping failed: errno %d", ctypes.get_errno())
        return 0
    return last - first
