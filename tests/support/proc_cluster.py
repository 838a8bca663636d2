"""A cluster of real processes (router, prefill and decode workers) over an embedded Redis, for fault tests.

Each service runs as its own `python -m ...` process, so a kill -9 is a real kill.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.ports import free_port
from common.redis_server import EmbeddedRedis, connect
from common.state import StateStore

REPO = Path(__file__).resolve().parents[2]
LEASE_TTL_S = 4.0  # the router's: a dead router's records must be terminal within it


@dataclass
class Proc:
    role: str
    name: str
    args: list[str]
    port: int
    kv_port: int = 0
    log_path: Path | None = None
    popen: subprocess.Popen | None = None
    extra_env: dict = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path and self.log_path.exists() else ""


class ProcCluster:
    def __init__(self, tmp_dir: Path, *, num_prefill: int = 1, num_decode: int = 2, kv_memory_gib: float = 0.05,
                 env: dict | None = None, proc_env: dict[str, dict] | None = None, model: str | None = None):
        """env: every process's extra environment; proc_env: one process's (by name, e.g. "decode-0");
        model: what every service serves (the default model if None)."""
        self.tmp_dir = Path(tmp_dir)
        self.model = model
        self.num_prefill, self.num_decode = num_prefill, num_decode
        self.kv_memory_gib = kv_memory_gib
        self.env = env or {}
        self.proc_env = proc_env or {}
        self.procs: dict[str, Proc] = {}

    def start(self) -> "ProcCluster":
        self.redis = EmbeddedRedis().start()
        client, _ = connect(self.redis.url)
        self.state = StateStore(client)
        for i in range(self.num_prefill):
            self.add("prefill", f"prefill-{i}")
        for i in range(self.num_decode):
            self.add("decode", f"decode-{i}")
        self.add("router", "router")
        for p in self.procs.values():
            self.spawn(p)
        for p in self.procs.values():
            self.wait_serving(p)
        return self

    def add(self, role: str, name: str) -> Proc:
        port = free_port()
        common = ["--host", "127.0.0.1", "--port", str(port), "--redis-url", self.redis.url,
                  "--metrics-port", "0", "--log-level", "WARNING", *(["--model", self.model] if self.model else [])]
        if role == "router":
            # HTTP on a free port: the default 8000 may be taken by another test session on this host.
            args = ["-m", "router", *common, "--lease-ttl-s", str(LEASE_TTL_S), "--http-port", "0"]
            proc = Proc(role, name, args, port)
        else:
            args = ["-m", f"{role}_svc", *common, "--advertise-host", "127.0.0.1", "--worker-id", name,
                    "--threads", "1", "--drain-timeout-s", "20"]
            kv_port = 0
            if role == "decode":
                kv_port = free_port()
                args += ["--kv-port", str(kv_port), "--kv-memory-gib", str(self.kv_memory_gib)]
            proc = Proc(role, name, args, port, kv_port)
        proc.log_path = self.tmp_dir / f"{name}.log"
        proc.extra_env = dict(self.proc_env.get(name, {}))
        self.procs[name] = proc
        return proc

    def spawn(self, p: Proc) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **self.env, **p.extra_env)
        env.pop("REDIS_PASSWORD", None)
        with open(p.log_path, "ab") as log:
            p.popen = subprocess.Popen([sys.executable, *p.args], cwd=REPO, env=env, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)

    def wait_serving(self, p: Proc, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(p.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                assert p.alive(), f"{p.name} exited with {p.popen.returncode}:\n{p.log()}"
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, f"{p.name} not SERVING after {timeout_s} s:\n{p.log()}"
                time.sleep(0.2)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> float:
        p = self.procs[name]
        p.popen.send_signal(sig)
        return time.monotonic()

    def restart(self, name: str) -> None:
        p = self.procs[name]
        if p.alive():
            p.popen.kill()
        p.popen.wait()
        self.spawn(p)
        self.wait_serving(p)

    @property
    def router_address(self) -> str:
        return self.procs["router"].address

    def decode_names(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.role == "decode" and p.alive()]

    def leftovers(self) -> dict[str, int]:
        """What the live workers still hold, as they report it: KV blocks in use (decode and prefill
        pools), sequences running or waiting (parked KV included) and leases in Redis."""
        out = {"blocks_used": 0, "sequences": 0, "leases": 0, "unregistered": 0}
        for name, p in self.procs.items():
            if p.role == "router" or not p.alive():
                continue
            info = self.state.get_worker(name)
            if info is None:
                out["unregistered"] += 1
                continue
            out["blocks_used"] += info.total_blocks - info.free_blocks
            out["sequences"] += info.num_running + info.num_waiting
            if p.role == "decode":
                out["leases"] += len(self.state.reservations(name))
        return out

    def wait_idle(self, timeout_s: float = 15.0) -> dict[str, int]:
        """Waits until every live worker is registered with all KV blocks free, nothing running or
        parked, and no lease is left; returns what was left at the first look (for the report)."""
        deadline = time.monotonic() + timeout_s
        first = None
        while True:
            left = self.leftovers()
            first = first or left
            if not any(left.values()):
                return first
            assert time.monotonic() < deadline, f"not idle after {timeout_s} s: {left}"
            time.sleep(0.1)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.alive():
                p.popen.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            if p.popen is not None:
                try:
                    p.popen.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    p.popen.wait()
        self.redis.stop()
