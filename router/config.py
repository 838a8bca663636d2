"""The router's configuration: one frozen dataclass, built once from flags and the environment."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from common import cli, security, settings
from common.redis_server import SOCKET_TIMEOUT_S
from common.security import TLSConfig
from common.settings import PREFILL_MODES, ROUTINGS, default


@dataclass(frozen=True)
class RouterConfig:
    """Defaults from common/settings.py (the flags' table), except where a library user differs from the
    command: a free port (0) and the HTTP API and metrics off (-1, 0) unless asked for."""
    host: str = default("host")
    port: int = 50051
    redis_url: str | None = None
    model: str = default("model")
    # The names the OpenAI API answers to, comma-separated (vLLM's --served-model-name): /v1/models lists
    # them, a request's "model" must be one of them, responses report the first. Empty = the model's own
    # name (common/engine/model_files.served_name: `smollm2`, a .gguf file's stem, an HF folder's name).
    served_model_name: str = default("served_model_name")
    metrics_port: int = 0
    generation_config: str = default("generation_config")  # auto: the model files' sampling settings fill unset fields
    default_max_tokens: int = default("default_max_tokens")
    max_messages: int = default("max_messages")
    max_request_s: float = default("max_request_s")
    lease_ttl_s: float = default("lease_ttl_s")
    heartbeat_s: float = 0.5  # the router's registration beat; its requests are reaped ...
    # ... this long after its last beat: more than one heartbeat that times out (the Redis socket timeout)
    # and the next beat, so a Redis that answers slowly for a moment does not get a live router reaped.
    heartbeat_ttl_s: float = 3.0
    queue_timeout_s: float = default("queue_timeout_s")
    max_queued: int = default("max_queued")
    kv_wait_s: float = default("kv_wait_s")
    max_attempts: int = default("max_attempts")
    prefill_mode: str = default("prefill_mode")
    remote_prefill_min_tokens: int = default("remote_prefill_min_tokens")
    remote_prefill_max_queue_ratio: float = default("remote_prefill_max_queue_ratio")
    remote_prefill_queue_max_tokens: int = default("remote_prefill_queue_max_tokens")
    routing: str = default("routing")
    cache_balance: int = default("cache_balance")
    # Streams cost memory, not a thread: requests are coroutines on the router's event loop.
    max_streams: int = default("max_streams")
    blocking_threads: int = 8  # the fixed pool that runs Redis calls and tokenization off the event loop
    drain_timeout_s: float = default("drain_timeout_s")
    health_port: int = default("health_port")
    # The OpenAI-compatible HTTP API (router/http_front.py): 0 = a free port, -1 = off. Off in the
    # dataclass (a library default); `python -m router` serves it on 8000, router.cluster too.
    http_port: int = -1
    max_body_bytes: int = default("max_body_bytes")  # the gRPC port's message limit too
    body_timeout_s: float = 30.0  # an HTTP request body must arrive within this (and its deadline), else 408
    # TLS on the public port (client certificates only if tls.require_client_cert) and mutual
    # TLS on the channels to the workers.
    tls: TLSConfig = TLSConfig()
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # empty = no API key needed; never printed
    # Where the keys came from: the file is re-read when it changes (the keys of HANDOFF_API_KEYS stay).
    api_keys_file: str | None = None
    api_keys_env: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be cache_aware or least_loaded, got {self.routing!r}")
        if self.generation_config not in settings.GENERATION_CONFIGS:
            raise ValueError(f"generation_config must be auto or none, got {self.generation_config!r}")
        if self.prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be one of {', '.join(PREFILL_MODES)}, got {self.prefill_mode!r}")
        if self.remote_prefill_min_tokens < 1:
            raise ValueError(f"remote_prefill_min_tokens must be >= 1, got {self.remote_prefill_min_tokens}")
        if self.remote_prefill_queue_max_tokens < 0:
            raise ValueError(f"remote_prefill_queue_max_tokens must be >= 0, "
                             f"got {self.remote_prefill_queue_max_tokens}")
        if not self.remote_prefill_max_queue_ratio >= 0:  # rejects NaN too
            raise ValueError(f"remote_prefill_max_queue_ratio must be >= 0 (0 = off), got "
                             f"{self.remote_prefill_max_queue_ratio}")
        if self.cache_balance < 0:
            raise ValueError(f"cache_balance must be >= 0, got {self.cache_balance}")
        for name in ("default_max_tokens", "max_messages", "max_queued", "max_attempts", "max_streams",
                     "blocking_threads", "max_body_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_request_s", "lease_ttl_s", "queue_timeout_s", "kv_wait_s", "drain_timeout_s",
                     "body_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.heartbeat_ttl_s <= SOCKET_TIMEOUT_S + self.heartbeat_s:
            raise ValueError(f"heartbeat_ttl_s must be longer than the Redis socket timeout ({SOCKET_TIMEOUT_S:g} s) "
                             f"plus heartbeat_s: one heartbeat that times out must not get a live router reaped")
        if not 0 < self.heartbeat_s < self.heartbeat_ttl_s <= self.lease_ttl_s:
            raise ValueError("heartbeat_s < heartbeat_ttl_s <= lease_ttl_s must hold (a dead router's "
                             "requests are ended within the lease TTL)")
        if self.http_port < -1:
            raise ValueError(f"http_port must be a port, 0 (a free one) or -1 (off), got {self.http_port}")
        names = self.served_model_names
        if self.served_model_name.strip() and (not all(names) or len(set(names)) != len(names)):
            raise ValueError(f"served_model_name must be distinct non-empty names separated by commas, "
                             f"got {self.served_model_name!r}")
        self.tls.check_for_service()

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """served_model_name's names; () when unset (the router then serves the model's own name)."""
        if not self.served_model_name.strip():
            return ()
        return tuple(name.strip() for name in self.served_model_name.split(","))

    @classmethod
    def from_args(cls, argv: list[str] | None) -> "RouterConfig":
        p = argparse.ArgumentParser(prog="python -m router", description="handoff router: the public Generate API")
        settings.add_to(p, settings.ROUTER)
        args = vars(p.parse_args(argv))
        cli.setup_logging(args.pop("log_level"))
        try:
            return cls.from_settings(args)
        except ValueError as exc:
            p.error(str(exc))

    @classmethod
    def from_settings(cls, args: dict) -> "RouterConfig":
        """The router's fields of parsed settings (router.cluster's carry the workers' too)."""
        names = {f.name for f in fields(cls)} - {"tls", "api_keys", "api_keys_env"}
        api_keys = security.read_api_keys(args.get("api_keys_file"), cli.api_keys_env())
        config = cls(tls=cli.tls_config(args), api_keys=api_keys,
                     api_keys_env=security.read_api_keys(None, cli.api_keys_env()),
                     **{k: v for k, v in args.items() if k in names})
        security.check(config.tls, "router")
        return config
