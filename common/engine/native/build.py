"""Building the library: the compiler and its flags, the cache folder keyed by the sources and the CPU,
the portable build an image ships, and kernel(), this process's loaded library (built on first use)."""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from common.engine.hardware import cpu_flags, switched_off
from common.engine.native.bindings import DecodeKernels

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")  # every .c in it goes into the one library; its headers into the key
# No -ffast-math: the kernel's sums must keep the order the source gives them, for invariant 4 (same inputs,
# same tokens).
# -fno-trapping-math (one part of it, which changes no value: FP exceptions are never read here) lets GCC
# turn a select into a blend, so that attention's softmax loop (exp_nonpositive's two selects) vectorizes:
# with traps assumed it stayed scalar.
# -fopenmp: the matmuls run on an OpenMP team, linked against the libgomp torch loaded (matmul_threads.c).
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-trapping-math", "-std=c11", "-fPIC", "-shared",
         "-fopenmp"]


def march_flags(march: str) -> list[str]:
    """FLAGS for another -march (a build for other machines, or the tests' other builds)."""
    return [f if f != "-march=native" else f"-march={march}" for f in FLAGS]


# For a library built on one machine and run on others (an image): AVX2 + FMA, which every host here has.
PORTABLE_FLAGS = march_flags("x86-64-v3")
ENV_SWITCH = "HANDOFF_NATIVE_ATTENTION"  # 0: no library, the eager path (torch ops) everywhere
ENV_CACHE = "HANDOFF_NATIVE_CACHE"  # where builds are kept (default: ~/.cache/handoff/native)
ENV_LIBRARY = "HANDOFF_NATIVE_LIBRARY"  # a prebuilt library, loaded instead of building one


def sources() -> list[Path]:
    """The library's C files (read at call time: tests point CSRC elsewhere)."""
    return sorted(CSRC.glob("*.c"))


def headers() -> list[Path]:
    return sorted(CSRC.glob("*.h"))


def cache_dir() -> Path:
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "handoff" / "native"


def build_key(compiler: str) -> str:
    """The sources, the headers, the compiler and its flags, and the CPU: a fleet of different hosts sharing
    a home folder never loads another machine's build."""
    h = hashlib.sha256()
    for path in [*sources(), *headers()]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(" ".join([compiler, *FLAGS, platform.machine(), *sorted(cpu_flags())]).encode())
    return h.hexdigest()[:16]


def find_compiler(compiler: str | None = None) -> str:
    compiler = compiler or os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH (install gcc, or set CC)")
    return compiler


def build_host(compiler: str | None = None) -> Path:
    """Compile the library for this CPU (or find its earlier build); returns the shared library's path.

    Raises RuntimeError saying what failed: no compiler, or the compiler's own message."""
    compiler = find_compiler(compiler)
    target = cache_dir() / f"decode_kernels-{build_key(compiler)}.so"
    if not target.exists():
        compile_library(compiler, FLAGS, target)
    return target


def build_portable(target: Path) -> Path:
    """Compile the library for any x86-64 with AVX2 into target (an image's, which has no compiler at run
    time and names it in HANDOFF_NATIVE_LIBRARY), and check that it loads with every function."""
    target = target.resolve()
    compile_library(find_compiler(), PORTABLE_FLAGS, target)
    DecodeKernels(target)
    return target


def compile_library(compiler: str, flags: list[str], target: Path) -> None:
    """Every source into one shared library at target, with these flags."""
    folder = target.parent
    folder.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed: processes starting at once never load a half-written file.
    fd, tmp = tempfile.mkstemp(prefix=".decode_kernels-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, *map(str, sources()), "-o", tmp, "-lm"], capture_output=True,
                              text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed building the native library from {CSRC}: "
                               f"{done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def kernel() -> DecodeKernels | None:
    """This process's kernels: HANDOFF_NATIVE_LIBRARY's, else this CPU's build (made on first call); None
    where they are switched off or cannot be built."""
    if switched_off(ENV_SWITCH):
        log.info("decode: eager path (%s=0)", ENV_SWITCH)
        return None
    try:
        prebuilt = os.environ.get(ENV_LIBRARY)
        return DecodeKernels(Path(prebuilt) if prebuilt else build_host())
    except (RuntimeError, OSError, AttributeError, subprocess.SubprocessError) as exc:
        log.warning("decode: the native kernels are unavailable, using the eager path (torch ops, gather + SDPA), "
                    "slower at every batch size: %s", exc)
        return None
