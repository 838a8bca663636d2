"""The router's configuration: one frozen dataclass, built once from flags and the environment."""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field

from common import cli, security
from common.security import TLSConfig


PREFILL_MODES = ("disaggregated", "colocated", "conditional")


@dataclass(frozen=True)
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = 50051
    redis_url: str | None = None
    model: str = "smollm2"
    # The names the OpenAI API answers to, comma-separated (vLLM's --served-model-name): /v1/models lists
    # them, a request's "model" must be one of them, responses report the first. Empty = the model's own
    # name (common/engine/model_files.served_name: `smollm2`, a .gguf file's stem, an HF folder's name).
    served_model_name: str = ""
    metrics_port: int = 0
    default_max_tokens: int = 256
    max_messages: int = 256  # chat messages per request
    max_request_s: float = 600.0  # a request without a client deadline gets this one
    lease_ttl_s: float = 10.0  # a dead router's reservations come back within this
    heartbeat_s: float = 0.5  # the router's registration beat; its requests are reaped ...
    heartbeat_ttl_s: float = 2.0  # ... this long after its last beat
    queue_timeout_s: float = 5.0  # how long a request may wait for decode capacity
    max_queued: int = 128  # requests waiting for capacity; beyond, RESOURCE_EXHAUSTED at once
    kv_wait_s: float = 30.0  # how long a decode worker waits for a request's KV
    max_attempts: int = 3  # tries of one request across workers (the retry budget)
    # Where prompts are prefilled: disaggregated (always on a prefill worker), colocated (on the decode
    # worker that decodes them; no prefill pool needed) or conditional (on a prefill worker when the
    # prompt has at least remote_prefill_min_tokens tokens, else on the decode worker).
    prefill_mode: str = "disaggregated"
    # 64 from `python -m bench.token_path --only placement` on 2 CPU cores (docs/operations.md): from 32-64 prompt
    # tokens on, remote prefill gave a TTFT within 1.1x of local (the push's fixed cost) and stalled a
    # decoding stream 34-61 ms instead of the whole prefill (124-183 ms at 32-64 tokens, 2.3 s at 1,024).
    remote_prefill_min_tokens: int = 64
    # Conditional: a prompt that would wait behind more than this many times its own length in prompt tokens
    # (this router's, on the least loaded prefill worker, in prompts no longer than it: a prefill worker runs
    # the shortest first) is prefilled on its decode worker instead (Dynamo's prefill-queue limit, in
    # tokens). At 3, a remote TTFT stays within about 4x of the prompt's own prefill. 0 = length alone.
    remote_prefill_max_queue_ratio: float = 3.0
    # ... but only a prompt of at most this many tokens: a longer one prefilled on the decode worker stops its
    # streams for seconds (measured: one 1,536-token prompt placed there made all 5 requests of a point miss
    # TPOT), so it queues for the prefill worker whatever the queue.
    remote_prefill_queue_max_tokens: int = 512
    routing: str = "cache_aware"  # prefill choice: cache_aware (longest cached prefix, load permitting) or least_loaded
    cache_balance: int = 4  # cache_aware: a worker may have this many more requests in flight than the least loaded
    # Generate streams in flight, per port (gRPC, HTTP): beyond, RESOURCE_EXHAUSTED (429) at once. A stream
    # costs memory, not a thread: requests are coroutines on the router's event loop.
    max_streams: int = 4096
    blocking_threads: int = 8  # the fixed pool that runs Redis calls and tokenization off the event loop
    drain_timeout_s: float = 25.0  # on SIGTERM, how long in-flight streams may take to finish
    health_port: int = 0  # plaintext grpc.health.v1 only, for probes when TLS is on; 0 = off
    # The OpenAI-compatible HTTP API (router/http_front.py): 0 = a free port, -1 = off. Off in the
    # dataclass (a library default); `python -m router` serves it on 8000, router.cluster too.
    http_port: int = -1
    max_body_bytes: int = 4 << 20  # largest HTTP request body; more is 413 (the gRPC port's message limit)
    # TLS on the public port (client certificates only if tls.require_client_cert) and mutual
    # TLS on the channels to the workers.
    tls: TLSConfig = TLSConfig()
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # empty = no API key needed; never printed

    def __post_init__(self) -> None:
        if self.routing not in ("cache_aware", "least_loaded"):
            raise ValueError(f"routing must be cache_aware or least_loaded, got {self.routing!r}")
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
        for name in ("max_request_s", "lease_ttl_s", "queue_timeout_s", "kv_wait_s", "drain_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
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
        cli.add_common_flags(p, port=50051, metrics_port=9100)
        cli.add_flag(p, "--http-port", "HANDOFF_HTTP_PORT", 8000,
                     "OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health, "
                     "/metrics); 0 = a free one, -1 = off", int)
        cli.add_flag(p, "--served-model-name", "HANDOFF_SERVED_MODEL_NAME", "",
                     "the model name(s) the OpenAI API answers to, comma-separated: /v1/models lists them, a "
                     "request's model must be one of them, responses report the first; empty = the model's "
                     "own name (smollm2, a .gguf file's stem, an HF folder's name)")
        cli.add_flag(p, "--queue-timeout-s", "HANDOFF_QUEUE_TIMEOUT_S", 5.0,
                     "how long a request may wait for decode capacity", float)
        cli.add_flag(p, "--max-queued", "HANDOFF_MAX_QUEUED", 128, "requests allowed to wait for capacity", int)
        cli.add_flag(p, "--lease-ttl-s", "HANDOFF_LEASE_TTL_S", 10.0, "KV reservation lease", float)
        cli.add_flag(p, "--prefill-mode", "HANDOFF_PREFILL_MODE", "disaggregated",
                     "where prompts are prefilled: disaggregated (on a prefill worker, KV pushed to the decode "
                     "worker), colocated (on the decode worker itself; no prefill pool needed) or conditional "
                     "(on a prefill worker from --remote-prefill-min-tokens prompt tokens on, else colocated)")
        cli.add_flag(p, "--remote-prefill-min-tokens", "HANDOFF_REMOTE_PREFILL_MIN_TOKENS",
                     RouterConfig.remote_prefill_min_tokens,
                     "conditional: the shortest prompt (in tokens) prefilled on a prefill worker "
                     "(measure yours: python -m bench.token_path --only placement)", int)
        cli.add_flag(p, "--remote-prefill-max-queue-ratio", "HANDOFF_REMOTE_PREFILL_MAX_QUEUE_RATIO",
                     RouterConfig.remote_prefill_max_queue_ratio,
                     "conditional: prefill on the decode worker a prompt that would queue behind more than "
                     "this many times its length in prompts no longer than it on the least loaded prefill worker "
                     "(0 = off)",
                     float)
        cli.add_flag(p, "--remote-prefill-queue-max-tokens", "HANDOFF_REMOTE_PREFILL_QUEUE_MAX_TOKENS",
                     RouterConfig.remote_prefill_queue_max_tokens,
                     "conditional: the longest prompt the queue rule may send to the decode worker", int)
        cli.add_flag(p, "--routing", "HANDOFF_ROUTING", "cache_aware",
                     "prefill worker choice: cache_aware (the longest cached prompt prefix, unless that worker is "
                     "busier than the least loaded by more than --cache-balance) or least_loaded")
        cli.add_flag(p, "--cache-balance", "HANDOFF_CACHE_BALANCE", 4,
                     "cache_aware: requests in flight a worker may have beyond the least loaded one", int)
        cli.add_flag(p, "--drain-timeout-s", "HANDOFF_DRAIN_TIMEOUT_S", 25.0,
                     "on SIGTERM, how long in-flight streams may take to finish", float)
        cli.add_public_tls_flags(p)
        cli.add_flag(p, "--api-keys-file", "HANDOFF_API_KEYS_FILE", None,
                     "file of API keys clients must send as 'authorization: Bearer <key>' (one per line, # comments); "
                     "keys may also come comma-separated in env HANDOFF_API_KEYS; none = no key needed")
        args = vars(p.parse_args(argv))
        logging.basicConfig(level=args.pop("log_level").upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        try:
            api_keys = security.read_api_keys(args.pop("api_keys_file"), cli.api_keys_env())
            config = cls(tls=cli.pop_tls_config(args), api_keys=api_keys, **args)
            security.check(config.tls)
            return config
        except ValueError as exc:
            p.error(str(exc))
