"""Prometheus metrics of every service, labelled by worker so one process can host several."""
from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# router
TTFT = Histogram("handoff_router_ttft_seconds", "Time from request arrival to its first token",
                 buckets=_LATENCY_BUCKETS)
ITL = Histogram("handoff_router_inter_token_seconds", "Time between consecutive streamed tokens",
                buckets=_LATENCY_BUCKETS)
E2E = Histogram("handoff_router_e2e_seconds", "Time from request arrival to its last token",
                buckets=_LATENCY_BUCKETS)
QUEUE = Histogram("handoff_router_queue_seconds", "Time a request waited for decode capacity",
                  buckets=_LATENCY_BUCKETS)
REQUESTS = Counter("handoff_router_requests_total", "Requests by how they ended", ["finish_reason"])
ROUTER_RUNNING = Gauge("handoff_router_running_requests", "Requests being served")
ROUTER_WAITING = Gauge("handoff_router_waiting_requests", "Requests waiting for decode capacity")
RETRIES = Counter("handoff_router_retries_total", "Attempts re-run on another worker", ["reason"])
HTTP_RESPONSES = Counter("handoff_router_http_responses_total", "OpenAI-compatible HTTP API answers by route and "
                         "status (499: the client left first)", ["route", "status"])
PLACEMENT = Counter("handoff_router_prefill_placement_total",
                    "Where attempts prefilled their prompt: on a prefill worker (remote) or on the decode worker "
                    "(local: colocated, or conditional below its threshold)", ["placement"])
ROUTED = Counter("handoff_router_prefill_choices_total",
                 "Prefill worker choices: for its cached prefix (cache) or its load (load)", ["choice"])

# workers
PREFILL_QUEUE = Gauge("handoff_prefill_queue_depth", "Prompts waiting or running prefill", ["worker"])
PREFILL_SECONDS = Histogram("handoff_prefill_seconds", "Prefill compute time of one request", ["worker"],
                            buckets=_LATENCY_BUCKETS)
DECODE_SESSION_MESSAGES = Counter("handoff_decode_session_messages_total",
                                  "DecodeSession messages sent to routers (each carries the new tokens of every "
                                  "request of the session from at most one engine step)", ["worker"])
DECODE_RUNNING = Gauge("handoff_decode_running_streams", "Sequences in the decode batch", ["worker"])
DECODE_WAITING = Gauge("handoff_decode_waiting", "Sequences waiting for KV or admission", ["worker"])
KV_BLOCKS_USED = Gauge("handoff_decode_kv_blocks_used", "KV blocks in use", ["worker"])
KV_BLOCKS_TOTAL = Gauge("handoff_decode_kv_blocks_total", "KV blocks in the pool", ["worker"])
KV_USED_RATIO = Gauge("handoff_decode_kv_blocks_used_ratio", "KV blocks in use / total", ["worker"])
KV_BYTES = Counter("handoff_kv_transfer_bytes_total", "KV bytes shipped", ["worker", "direction"])
KV_SECONDS = Histogram("handoff_kv_transfer_seconds", "Seconds per KV transfer", ["worker"],
                       buckets=_LATENCY_BUCKETS)
KV_EXPOSED_SECONDS = Histogram("handoff_kv_transfer_exposed_seconds",
                               "Seconds from a prefill's first token to its KV push's reply: the transfer the "
                               "prefill did not hide", ["worker"], buckets=_LATENCY_BUCKETS)
KV_FAILURES = Counter("handoff_kv_transfer_failures_total", "KV transfers that failed", ["worker", "reason"])
AUTHZ_DENIED = Counter("handoff_authz_denied_total", "Internal calls refused PERMISSION_DENIED for the caller's "
                       "role (common/authz.py); caller_role none = no handoff identity", ["method", "caller_role"])
PREFIX_TOKENS = Counter("handoff_prefix_cache_tokens_total",
                        "Prompt tokens admitted for prefill (kind=prompt) and of them found in the prefix cache "
                        "(kind=cached); hit rate = cached / prompt", ["worker", "kind"])

_started: dict[int, int] = {}  # port asked for -> port bound


def serve_metrics(port: int) -> int:
    """Expose /metrics on `port`: 0 picks a free port, -1 is off. Returns the bound port (0 when off);
    several services in one process share one endpoint."""
    if port < 0:
        return 0
    if port in _started:
        return _started[port]
    try:
        server, _ = start_http_server(port)
    except OSError as exc:
        raise SystemExit(f"cannot serve metrics on port {port}: {exc.strerror or exc}; another process (another "
                         f"worker on this host?) uses it: choose another with --metrics-port "
                         f"(0 picks a free one, -1 turns metrics off)") from None
    bound = server.server_port
    _started[port] = bound
    log.info("metrics on :%d/metrics", bound)
    return bound
