"""Command-line flags with environment-variable defaults: the one place services read the environment."""
from __future__ import annotations

import argparse
import os
import socket

from common.security import TLSConfig


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
             "Prometheus /metrics HTTP port; 0 = a free one (a worker registers it in Redis), -1 = off", int)
    add_flag(parser, "--log-level", "HANDOFF_LOG_LEVEL", "INFO", "logging level")
    add_tls_flags(parser)
    add_flag(parser, "--health-port", "HANDOFF_HEALTH_PORT", 0,
             "a plaintext port serving only grpc.health.v1, for probes that cannot speak TLS; 0 = off", int)


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    """PEM files (a mounted Kubernetes Secret); none set = plaintext everywhere."""
    add_flag(parser, "--tls-cert", "HANDOFF_TLS_CERT", None,
             "this service's certificate chain: served on its ports and presented as client certificate")
    add_flag(parser, "--tls-key", "HANDOFF_TLS_KEY", None, "the private key of --tls-cert")
    add_flag(parser, "--tls-ca", "HANDOFF_TLS_CA", None,
             "CA bundle that peers' certificates must chain to; internal ports then require client certificates")
    add_flag(parser, "--tls-server-name", "HANDOFF_TLS_SERVER_NAME", None,
             "name expected in the certificates of the servers this process calls (they register IPs)")


def add_public_tls_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--tls-require-client-cert", "HANDOFF_TLS_REQUIRE_CLIENT_CERT", False,
             "also require client certificates on the public port (otherwise API keys authenticate)", boolean)


def pop_tls_config(args: dict) -> TLSConfig:
    """The TLS flags of parsed `args` (removed from it) as one TLSConfig."""
    return TLSConfig(cert=args.pop("tls_cert"), key=args.pop("tls_key"), ca=args.pop("tls_ca"),
                     server_name=args.pop("tls_server_name"),
                     require_client_cert=args.pop("tls_require_client_cert", False))


def boolean(text: str) -> bool:
    """A flag's or environment variable's yes/no (1/0, true/false, yes/no, on/off)."""
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def add_worker_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--advertise-host", "HANDOFF_ADVERTISE_HOST", None,
             "host other services reach this worker at (a pod sets it from status.podIP); "
             "unset = this machine's hostname")
    add_flag(parser, "--worker-id", "HANDOFF_WORKER_ID", None, "registry id; unset = <hostname>-<port>")
    add_flag(parser, "--dtype", "HANDOFF_DTYPE", "auto",
             "weights and KV dtype: auto (bf16 on CUDA and on CPUs with native bf16 matmuls, "
             "AVX512_BF16 or AMX; else fp32), fp32, bf16 or fp16; prefill and decode pools must agree")
    add_flag(parser, "--device", "HANDOFF_DEVICE", "cpu", "torch device: cpu or cuda[:N]")
    add_flag(parser, "--threads", "HANDOFF_THREADS", 0, "torch intra-op threads; 0 = all cores", int)
    add_flag(parser, "--drain-timeout-s", "HANDOFF_DRAIN_TIMEOUT_S", 25.0,
             "on SIGTERM, how long in-flight requests may take to finish", float)
    add_flag(parser, "--prefill-chunk-tokens", "HANDOFF_PREFILL_CHUNK_TOKENS", 256,
             "prompts are prefilled in chunks of this many tokens at fixed positions, and the K/V of whole chunks "
             "is reused by prompts that share them; a multiple of the block size, the same on every worker", int)
    add_flag(parser, "--prefix-caching", "HANDOFF_PREFIX_CACHING", True,
             "keep the K/V of prompt chunks for later prompts with the same prefix", parse_bool)
    add_flag(parser, "--packed-decode", "HANDOFF_PACKED_DECODE", True,
             "decode with the GGUF's packed weights as stored (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K); "
             "false = the dtype's dense matmuls", parse_bool)
    add_flag(parser, "--dense-weights", "HANDOFF_DENSE_WEIGHTS", "auto",
             "dense copies of the packed matrices for prefill's GEMMs: keep (held from load), lazy (made from "
             "the file layer by layer when a prefill runs: the pod's memory is the file plus the KV pool, "
             "prefill is slower) or auto (prefill workers keep; decode workers lazy: set keep on decode "
             "workers that prefill, colocated or conditional)", str)


def parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def redis_password() -> str | None:
    """From the environment only (a Kubernetes Secret), never from a flag that `ps` would show."""
    return env("REDIS_PASSWORD")


def redis_username() -> str | None:
    """The Redis ACL user; unset = the default user (requirepass)."""
    return env("REDIS_USERNAME")


def api_keys_env() -> str | None:
    """Comma-separated API keys, from the environment only (never a flag that `ps` would show)."""
    return env("HANDOFF_API_KEYS")


def default_host() -> str:
    return socket.gethostname()
