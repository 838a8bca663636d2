"""Command-line flags with environment-variable defaults: the one place services read the environment."""
from __future__ import annotations

import argparse
import os
import socket


def env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def add_flag(parser: argparse.ArgumentParser, flag: str, env_name: str, default, help: str, type=str) -> None:
    """A flag whose default comes from `env_name`; the flag wins over the environment."""
    raw = env(env_name)
    try:
        value = type(raw) if raw is not None else default
    except ValueError:
        parser.error(f"environment variable {env_name}={raw!r} is not a valid {type.__name__}")
    parser.add_argument(flag, type=type, default=value, help=f"{help} (env {env_name}; default {default!r})")


def add_common_flags(parser: argparse.ArgumentParser, *, port: int, metrics_port: int) -> None:
    add_flag(parser, "--host", "HANDOFF_HOST", "0.0.0.0", "address to listen on")
    add_flag(parser, "--port", "HANDOFF_PORT", port, "gRPC port", int)
    add_flag(parser, "--redis-url", "REDIS_URL", None,
             "Redis URL (redis://host:port/db); unset = start an embedded Redis server")
    add_flag(parser, "--model", "HANDOFF_MODEL", "smollm2",
             "a .gguf file, an HF checkpoint folder, or a short name (smollm2)")
    add_flag(parser, "--metrics-port", "HANDOFF_METRICS_PORT", metrics_port,
             "Prometheus /metrics HTTP port; 0 = off", int)
    add_flag(parser, "--log-level", "HANDOFF_LOG_LEVEL", "INFO", "logging level")


def add_worker_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--advertise-host", "HANDOFF_ADVERTISE_HOST", None,
             "host other services reach this worker at (a pod sets it from status.podIP); "
             "unset = this machine's hostname")
    add_flag(parser, "--worker-id", "HANDOFF_WORKER_ID", None, "registry id; unset = <hostname>-<port>")
    add_flag(parser, "--dtype", "HANDOFF_DTYPE", "bf16", "weights and KV dtype: fp32, bf16 or fp16")
    add_flag(parser, "--device", "HANDOFF_DEVICE", "cpu", "torch device: cpu or cuda[:N]")
    add_flag(parser, "--threads", "HANDOFF_THREADS", 0, "torch intra-op threads; 0 = all cores", int)
    add_flag(parser, "--drain-timeout-s", "HANDOFF_DRAIN_TIMEOUT_S", 25.0,
             "on SIGTERM, how long in-flight requests may take to finish", float)


def redis_password() -> str | None:
    """From the environment only (a Kubernetes Secret), never from a flag that `ps` would show."""
    return env("REDIS_PASSWORD")


def default_host() -> str:
    return socket.gethostname()
