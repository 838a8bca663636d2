"""Services started as separate processes without --redis-url: the first one's embedded Redis is announced with
the flags that join it, and the three processes serve as one cluster (no silent clusters of one)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from common.ports import free_port
from tests.deploy.test_run_as_processes import wait_serving

ROOT = Path(__file__).resolve().parents[2]
JOIN = re.compile(r"embedded Redis at (redis://127\.0\.0\.1:\d+/0).*--redis-url (\S+)")


def _start(module: str, args: list[str], log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("HANDOFF_")}
    env["HANDOFF_THREADS"] = "1"
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)


def _wait_for(pattern: re.Pattern, log: Path, proc: subprocess.Popen, deadline: float) -> re.Match:
    while time.monotonic() < deadline:
        if (match := pattern.search(log.read_text(errors="replace"))):
            return match
        if proc.poll() is not None:
            pytest.fail(f"exited with {proc.returncode} before announcing its Redis:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    pytest.fail(f"no announcement of the embedded Redis within the deadline:\n{log.read_text()[-3000:]}")


def test_three_processes_join_the_first_ones_embedded_redis(tmp_path):
    from protos import handoff_pb2, handoff_pb2_grpc

    router_port, prefill_port, decode_port, kv_port = (free_port() for _ in range(4))
    logs = {name: tmp_path / f"{name}.log" for name in ("router", "prefill", "decode", "stray")}
    procs = {"router": _start("router", ["--port", str(router_port), "--http-port", "-1", "--metrics-port", "-1"],
                              logs["router"])}
    try:
        deadline = time.monotonic() + 120
        match = _wait_for(JOIN, logs["router"], procs["router"], deadline)
        url, join_url = match.groups()
        assert join_url == url, "the announced flag names the server it announces"
        worker_flags = ["--redis-url", url, "--advertise-host", "127.0.0.1", "--metrics-port", "-1"]
        procs["prefill"] = _start("prefill_svc", [*worker_flags, "--port", str(prefill_port)], logs["prefill"])
        procs["decode"] = _start("decode_svc", [*worker_flags, "--port", str(decode_port), "--kv-port",
                                                str(kv_port), "--kv-memory-gib", "0.25"], logs["decode"])
        # A worker started without the flag says so too: it runs a Redis of its own, which it names.
        procs["stray"] = _start("decode_svc", ["--port", str(free_port()), "--metrics-port", "-1",
                                               "--kv-memory-gib", "0.25"], logs["stray"])
        stray = _wait_for(JOIN, logs["stray"], procs["stray"], deadline)
        assert stray.group(1) != url

        def all_logs() -> str:
            return "\n".join(f"--- {n} ---\n{p.read_text(errors='replace')[-2000:]}" for n, p in logs.items()
                             if p.exists())

        for name, port in (("prefill", prefill_port), ("decode", decode_port), ("router", router_port)):
            wait_serving(port, procs[name], deadline, name, all_logs)
        request = handoff_pb2.GenerateRequest(prompt="The capital of France is", max_tokens=8, temperature=0.0)
        with grpc.insecure_channel(f"127.0.0.1:{router_port}") as channel:
            stub = handoff_pb2_grpc.RouterStub(channel)
            while True:  # the router learns of the workers from Redis within a heartbeat or two
                try:
                    replies = list(stub.Generate(request, timeout=60))
                    break
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                        pytest.fail(f"Generate: {exc.code().name}: {exc.details()}\n{all_logs()}")
                    time.sleep(0.5)
        num_tokens = sum(len(r.token_ids) for r in replies)
        assert num_tokens == 8, f"{num_tokens} tokens through the three processes"
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
