"""The services of one loadgen mode as separate processes, each worker pinned to its cores with taskset.

A mode is a list of workers (role, cores, torch threads) and the router's prefill placement. The router
and the load generator are not pinned: they share both cores with the workers (loadgen says so in its
output). Everything listens on 127.0.0.1; Redis is an embedded server of its own.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import settings
from common import redis_server
from common.ports import free_port
from common.redis_server import EmbeddedRedis, connect
from common.state import StateStore
from router.config import RouterConfig

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0  # a worker loads the model (a few seconds) and warms up; two cores are shared
STOP_TIMEOUT_S = 30.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class WorkerSpec:
    role: str  # "prefill" or "decode"
    name: str
    cores: str  # taskset -c list, e.g. "0" or "0-1"
    threads: int  # torch intra-op threads


@dataclass(frozen=True)
class Mode:
    name: str
    prefill_mode: str  # the router's --prefill-mode
    workers: tuple[WorkerSpec, ...]
    about: str  # one line for the output


def modes(remote_prefill_min_tokens: int,
          remote_prefill_max_queue_ratio: float = RouterConfig.remote_prefill_max_queue_ratio) -> dict[str, Mode]:
    p0 = WorkerSpec("prefill", "prefill-0", "0", 1)
    d1 = WorkerSpec("decode", "decode-0", "1", 1)
    cond = (f"conditional (prompts >= {remote_prefill_min_tokens} tokens prefilled remotely"
            + (f", unless more than {remote_prefill_max_queue_ratio:g}x their length is queued there in prompts no"
               " longer than them)"
               if remote_prefill_max_queue_ratio else ")"))
    return {m.name: m for m in (
        Mode("disaggregated", "disaggregated", (p0, d1), "1 prefill (core 0) + 1 decode (core 1), 1 thread each"),
        Mode("colocated-1x2t", "colocated", (WorkerSpec("decode", "decode-0", "0-1", 2),),
             "1 colocated worker, 2 threads, cores 0-1"),
        Mode("colocated-2x1t", "colocated", (WorkerSpec("decode", "decode-0", "0", 1),
                                             WorkerSpec("decode", "decode-1", "1", 1)),
             "2 colocated workers, 1 thread each, cores 0 and 1"),
        Mode("conditional", "conditional", (p0, d1), "1 prefill (core 0) + 1 decode (core 1), 1 thread each, " + cond),
    )}


def router_prefill_modes() -> bool:
    """Whether this checkout's router takes --prefill-mode (colocated and conditional need it)."""
    out = subprocess.run([sys.executable, "-m", "router", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    return "--prefill-mode" in out.stdout


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (its threads included), from /proc; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of stat(5)


@dataclass
class Proc:
    name: str
    role: str
    argv: list[str]
    port: int
    threads: int
    log_path: Path
    popen: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""


class PinnedCluster:
    """Redis, the mode's workers and a router; `with` it, so every process stops on any exit."""

    def __init__(self, mode: Mode, log_dir: Path, *, dtype: str = settings.default("dtype"), kv_memory_gib: float = settings.default("kv_memory_gib"),
                 remote_prefill_min_tokens: int = RouterConfig.remote_prefill_min_tokens,
                 remote_prefill_max_queue_ratio: float = RouterConfig.remote_prefill_max_queue_ratio):
        self.mode, self.log_dir = mode, Path(log_dir)
        self.dtype, self.kv_memory_gib = dtype, kv_memory_gib
        self.remote_prefill_min_tokens = remote_prefill_min_tokens
        self.remote_prefill_max_queue_ratio = remote_prefill_max_queue_ratio
        self.taskset = shutil.which("taskset")
        self.procs: list[Proc] = []
        self.redis: EmbeddedRedis | None = None

    def __enter__(self) -> "PinnedCluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "PinnedCluster":
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis = EmbeddedRedis().start()
        self.state = StateStore(connect(self.redis.url)[0])
        for w in self.mode.workers:
            port = free_port()
            argv = self.worker_argv(w, port, free_port() if w.role == "decode" else 0)
            self._spawn(Proc(w.name, w.role, argv, port, w.threads, self.log_dir / f"{self.mode.name}-{w.name}.log"))
        port = free_port()
        self._spawn(Proc("router", "router", self.router_argv(port), port, 0,
                         self.log_dir / f"{self.mode.name}-router.log"))
        deadline = time.monotonic() + START_TIMEOUT_S
        for p in self.procs:
            self._wait_serving(p, deadline)
        self._wait_registered(deadline)
        return self

    def _common_flags(self) -> list[str]:
        url = self.redis.url if self.redis else "redis://127.0.0.1:0/0"
        return ["--host", "127.0.0.1", "--redis-url", url, "--metrics-port", "0", "--log-level", "WARNING"]

    def worker_argv(self, w: WorkerSpec, port: int, kv_port: int) -> list[str]:
        argv = [sys.executable, "-m", f"{w.role}_svc", *self._common_flags(), "--port", str(port),
                "--advertise-host", "127.0.0.1", "--worker-id", w.name, "--threads", str(w.threads),
                "--dtype", self.dtype]
        if w.role == "decode":
            argv += ["--kv-port", str(kv_port), "--kv-memory-gib", str(self.kv_memory_gib)]
        return [self.taskset, "-c", w.cores, *argv] if self.taskset else argv

    def router_argv(self, port: int) -> list[str]:
        argv = [sys.executable, "-m", "router", *self._common_flags(), "--port", str(port), "--http-port", "-1"]
        if self.mode.prefill_mode != "disaggregated":  # the flag exists only where the modes do
            argv += ["--prefill-mode", self.mode.prefill_mode]
        if self.mode.prefill_mode == "conditional":
            argv += ["--remote-prefill-min-tokens", str(self.remote_prefill_min_tokens),
                     "--remote-prefill-max-queue-ratio", str(self.remote_prefill_max_queue_ratio)]
        return argv

    def _spawn(self, p: Proc) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(max(p.threads, 1)))
        env.pop("REDIS_PASSWORD", None)
        env.pop("HANDOFF_PREFILL_MODE", None)  # the mode comes from the flag, never from the caller's shell
        with open(p.log_path, "wb") as log:
            # A session of its own: a Ctrl-C to the load generator does not reach the services before
            # stop() drains them. The embedded Redis's guard: the kernel SIGTERMs the service if the load
            # generator dies, even by kill -9 (taskset execs python, which keeps it).
            p.popen = subprocess.Popen(redis_server.die_with_parent(p.argv), cwd=REPO, env=env, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)

    def _wait_serving(self, p: Proc, deadline: float) -> None:
        with grpc.insecure_channel(p.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                if not p.alive():
                    raise RuntimeError(f"{p.name} exited with {p.popen.returncode}:\n{p.log_tail()}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{p.name} not SERVING after {START_TIMEOUT_S} s:\n{p.log_tail()}")
                time.sleep(0.2)

    def _wait_registered(self, deadline: float) -> None:
        """Until the router can see every worker in the registry (it picks from there)."""
        names = {w.name for w in self.mode.workers}
        while {w.worker_id for w in self.state.list_workers()} < names:
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers not registered after {START_TIMEOUT_S} s")
            time.sleep(0.2)

    @property
    def router_address(self) -> str:
        return next(p.address for p in self.procs if p.role == "router")

    def check_alive(self) -> None:
        for p in self.procs:
            if not p.alive():
                raise RuntimeError(f"{p.name} died with {p.popen.returncode}:\n{p.log_tail()}")

    def cpu_seconds(self) -> dict[str, float]:
        return {p.name: cpu_seconds(p.popen.pid) for p in self.procs if p.popen is not None}

    def prefill_seconds(self) -> dict[str, float]:
        """Each prefill worker's handoff_prefill_seconds_sum, scraped from its /metrics (registered in Redis)."""
        out = {}
        for info in self.state.list_workers("prefill"):
            if not info.metrics_port:
                continue
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{info.metrics_port}/metrics", timeout=2) as r:
                    text = r.read().decode()
            except OSError:
                continue
            out[info.worker_id] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                      if line.startswith("handoff_prefill_seconds_sum"))
        return out

    def stop(self) -> None:
        for p in self.procs:
            if p.alive():
                p.popen.send_signal(signal.SIGTERM)
        for p in self.procs:
            if p.popen is None:
                continue
            try:
                p.popen.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait()
        self.procs = []
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
