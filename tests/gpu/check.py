"""`make gpu-check` (python -m tests.gpu.check): the CUDA path, on a machine with a GPU, in under 10 minutes.

    make gpu-check                     # every step below
    python -m tests.gpu.check --list   # what it would run

1. tests/gpu/test_gpu.py: our Llama on the GPU in bf16 and fp32 against HF transformers on the GPU in fp32 (logits
   within the stated tolerance, the same most likely token); invariant 4 (same tokens) at any batch size on the GPU; K/V
   from the host (a push's buffer) parked in a pool on the GPU; a whole cluster (one prefill, two decode
   workers) on the GPU in bf16: greedy tokens HF's, and the engine's alone.
2. The engine-failure tests on the GPU (HANDOFF_TEST_DEVICE=cuda): K/V that cannot be placed refused alone; a
   failed engine thread ends everything and its worker leaves service within the heartbeat TTL, its
   requests finishing on the other decode worker with the fault-free tokens.
3. kill -9 of a decode worker mid-stream, real service processes on the GPU (HANDOFF_DEVICE=cuda): every
   stream completes with the fault-free tokens, greedy and seeded (tests/faults/test_faults.py).
4. The engine benchmark on the GPU: python -m bench.engine --device cuda --quick --only prefill decode.

Each step's output streams through; the last lines sum up. It exits 1 if any step failed or ran out of its
time. Without a CUDA device it says so and exits 0: there is nothing to check.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUDGET_S = 570  # the whole check, under 10 minutes
PYTEST = ["-m", "pytest", "-q", "-s", "-p", "no:cacheprovider"]

# (what, command after the interpreter, extra environment, most seconds it may take)
STEPS = [
    ("numerics against HF, K/V from the host, a cluster on the GPU", [*PYTEST, "tests/gpu/test_gpu.py"], {}, 180),
    ("engine failures on the GPU", [*PYTEST, "tests/engine/test_engine_failures.py", "tests/faults/test_faults_engine.py"],
     {"HANDOFF_TEST_DEVICE": "cuda"}, 150),
    ("kill -9 a decode worker mid-stream, service processes on the GPU",
     [*PYTEST, "tests/faults/test_faults.py::test_kill_mid_stream[decode-0]"], {"HANDOFF_DEVICE": "cuda"}, 180),
    ("the engine benchmark on the GPU",
     ["-m", "bench.engine", "--device", "cuda", "--quick", "--only", "prefill", "decode"], {}, 150),
]


def cuda_device() -> str | None:
    """The GPU's name, or None where torch sees no CUDA device."""
    import torch
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0)


def run_step(what: str, args: list[str], env: dict, timeout_s: float) -> tuple[str, float]:
    print(f"\n=== gpu-check: {what} (at most {timeout_s:.0f} s)\n    {' '.join(args)}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env={**os.environ, **env}, start_new_session=True)
    try:
        status = "passed" if proc.wait(timeout=timeout_s) == 0 else f"FAILED (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the step and whatever service processes it started
        proc.wait()
        status = f"FAILED (out of time after {timeout_s:.0f} s)"
    return status, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.gpu.check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="print the steps and exit")
    args = p.parse_args(argv)
    if args.list:
        for what, cmd, env, timeout_s in STEPS:
            print(f"{what}: {' '.join(f'{k}={v}' for k, v in env.items())} python {' '.join(cmd)} (<= {timeout_s} s)")
        return 0
    import torch
    gpu = cuda_device()
    if gpu is None:
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}, "
              f"{'CUDA ' + torch.version.cuda if torch.version.cuda else 'a build without CUDA'}); nothing to check")
        return 0
    print(f"gpu-check on {gpu} (torch {torch.__version__}, CUDA {torch.version.cuda}), budget {BUDGET_S} s", flush=True)
    deadline = time.monotonic() + BUDGET_S
    results = []
    for what, cmd, env, timeout_s in STEPS:
        left = deadline - time.monotonic()
        if left < 30:
            results.append((what, "SKIPPED (the check's time is spent)", 0.0))
            continue
        results.append((what, *run_step(what, cmd, env, min(timeout_s, left))))
    print("\n=== gpu-check summary")
    for what, status, took_s in results:
        print(f"  {status:<40} {took_s:6.0f} s  {what}")
    return 0 if all(status == "passed" for _, status, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
