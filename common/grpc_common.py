"""What every gRPC server and channel of handoff shares: limits, the error interceptor, health.

Servicer methods stay thin: they raise `ServiceError` (or a domain ValueError) and the
one interceptor here turns it into a gRPC status, for every RPC of the server.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import urllib.parse
from concurrent import futures
from typing import Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

# Deliberate message limits: a KV chunk is ~1 MiB; public requests are prompts, far smaller.
MAX_INTERNAL_MESSAGE_BYTES = 8 << 20
MAX_PUBLIC_MESSAGE_BYTES = 4 << 20

KEEPALIVE_OPTIONS = [
    # A peer that dies without closing its socket is noticed within seconds, not minutes.
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
]


class ServiceError(Exception):
    """A failure with the gRPC status it should reach the caller as, and trailing metadata to send
    with it (e.g. which downstream worker failed: internal.proto's handoff-failed-* trailers).
    `detail`, when given, is what the log and the request record get instead of `message`: the
    router's public errors keep worker ids, addresses and the Redis URL there, out of the message."""

    def __init__(self, code: grpc.StatusCode, message: str, trailers: tuple[tuple[str, str], ...] = (),
                 detail: str = ""):
        super().__init__(message)
        self.code = code
        self.message = message
        self.trailers = trailers
        self.detail = detail or message


# Trailers a worker sets when the failure it reports is another worker's (internal.proto).
FAILED_ROLE, FAILED_WORKER, FAILED_EPOCH = "handoff-failed-role", "handoff-failed-worker", "handoff-failed-epoch"


# A metadata value must be printable ASCII, or gRPC fails the whole call with INTERNAL ("Invalid
# metadata") and drops the status it was meant to carry. Ids come from peers (a KVTarget names any
# worker), so values are percent-encoded outside printable ASCII, as grpc-message is.
_METADATA_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


def blame(role: str, worker_id: str, epoch: str) -> tuple[tuple[str, str], ...]:
    return tuple((key, urllib.parse.quote(value, safe=_METADATA_SAFE, errors="surrogatepass"))
                 for key, value in ((FAILED_ROLE, role), (FAILED_WORKER, worker_id), (FAILED_EPOCH, epoch)))


def blamed(exc: grpc.RpcError) -> tuple[str, str, str] | None:
    """(role, worker_id, epoch) a failed call's trailers charge the failure to, if any."""
    try:
        trailers = dict(exc.trailing_metadata() or ())
    except Exception:  # an RpcError without metadata (e.g. raised locally)
        return None
    if FAILED_ROLE not in trailers or FAILED_WORKER not in trailers:
        return None
    role, worker_id, epoch = trailers[FAILED_ROLE], trailers[FAILED_WORKER], trailers.get(FAILED_EPOCH, "")
    return tuple(urllib.parse.unquote(value, errors="surrogatepass") for value in (role, worker_id, epoch))


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        # A downstream call failed: keep its code, say where it came from.
        return exc.code(), f"downstream call failed: {exc.details()}"
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


class _Undecodable:
    """A request message that did not parse: invalid UTF-8 in a string field, a malformed message."""

    def __init__(self, error: Exception):
        self.error = error


def lenient(deserializer):
    """gRPC answers a request that fails to parse with INTERNAL ("Exception deserializing
    request!") before any handler runs; parse it here instead, so the handler can refuse it."""
    if deserializer is None:
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:
            return _Undecodable(exc)
    return parse


def parsed(request):
    if isinstance(request, _Undecodable):
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {request.error}")
    return request


class _ParsedStream:
    """A request stream whose messages are parsed as they are read: one that does not parse raises
    INVALID_ARGUMENT (ServiceError) from next(), and the stream can still be read on past it (a
    decode session skips such a message rather than end every request it carries)."""

    def __init__(self, requests):
        self._requests = iter(requests)

    def __iter__(self):
        return self

    def __next__(self):
        return parsed(next(self._requests))


_parsed_stream = _ParsedStream


class ErrorInterceptor(grpc.ServerInterceptor):
    """Turns any exception a handler raises into a gRPC status with a readable message, and a
    request that does not parse into INVALID_ARGUMENT."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        def guard_unary(behavior, parse):
            def wrapped(request, context):
                try:
                    return behavior(parse(request), context)
                except Exception as exc:
                    _abort(context, method, exc)
            return wrapped

        def guard_stream(behavior, parse):
            def wrapped(request, context):
                try:
                    yield from behavior(parse(request), context)
                except Exception as exc:
                    _abort(context, method, exc)
            return wrapped

        handler = handler._replace(request_deserializer=lenient(handler.request_deserializer))
        if handler.unary_unary:
            return handler._replace(unary_unary=guard_unary(handler.unary_unary, parsed))
        if handler.unary_stream:
            return handler._replace(unary_stream=guard_stream(handler.unary_stream, parsed))
        if handler.stream_unary:
            return handler._replace(stream_unary=guard_unary(handler.stream_unary, _parsed_stream))
        if handler.stream_stream:
            return handler._replace(stream_stream=guard_stream(handler.stream_stream, _parsed_stream))
        return handler


def reported(method: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The status `exc` reaches the caller as, logged (with the traceback when it is a bug). Call it
    in the except block that caught `exc`."""
    code, message = status_for(exc)
    # A traced call's failure (common/tracing.fail) names its trace, to find the spans from the log line.
    trace = f" (trace {exc.trace_id})" if getattr(exc, "trace_id", "") else ""
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed%s", method, trace)
    else:
        log.info("%s: %s: %s%s", method, code.name, message, trace)
    return code, message


def _abort(context: grpc.ServicerContext, method: str, exc: Exception) -> None:
    code, message = reported(method, exc)
    if isinstance(exc, ServiceError) and exc.trailers:
        context.set_trailing_metadata(exc.trailers)
    context.abort(code, message)


def make_server(max_workers: int, *, max_message_bytes: int,
                interceptors: tuple[grpc.ServerInterceptor, ...] = ()) -> grpc.Server:
    """`interceptors` run before the error interceptor (authentication refuses a call first)."""
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=[*interceptors, ErrorInterceptor()],
        # Beyond this many calls gRPC answers RESOURCE_EXHAUSTED at once instead of queueing unseen.
        maximum_concurrent_rpcs=max_workers,
        options=[("grpc.max_receive_message_length", max_message_bytes),
                 ("grpc.max_send_message_length", max_message_bytes),
                 ("grpc.so_reuseport", 0), *KEEPALIVE_OPTIONS],
    )


LIVENESS = "liveness"


def add_health_and_reflection(server: grpc.Server, service_names: list[str]) -> health.HealthServicer:
    """Standard grpc.health.v1 (NOT_SERVING until the caller says ready) and server reflection."""
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ["", *service_names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    # Liveness: the process answers. Kubernetes' livenessProbe asks for this service, readiness for "".
    health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME], server)
    return health_servicer


def set_serving(health_servicer: health.HealthServicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        health_servicer.set(name, status)


def set_dead(health_servicer: health.HealthServicer, service_names: list[str]) -> None:
    """NOT_SERVING everywhere, liveness too: the process can serve nothing more until it is restarted."""
    set_serving(health_servicer, service_names, False)
    health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.NOT_SERVING)


class PortInUse(RuntimeError):
    """A port could not be bound; the message names the flag that sets it."""


def bind(server: grpc.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None,
         flag: str = "the port flag") -> int:
    """Bind a port, with TLS when credentials are given; port 0 picks a free one.

    Returns the bound port or raises PortInUse naming `flag`."""
    address = f"{host}:{port}"
    try:
        bound = (server.add_secure_port(address, credentials) if credentials is not None
                 else server.add_insecure_port(address))
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise PortInUse(f"cannot listen on {address}: another process (another worker on this host?) "
                        f"uses port {port}; choose another with {flag} (0 picks a free one)")
    return bound


def serve_health(health_servicer: health.HealthServicer, host: str, port: int) -> grpc.Server:
    """A second, plaintext server with only grpc.health.v1 (the same servicer, so the same status).

    The kubelet's gRPC probe cannot speak TLS: with TLS on, probes use this port.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="health"),
                         maximum_concurrent_rpcs=8, options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bind(server, host, port, flag="--health-port")
    server.start()
    return server


def channel(address: str, *, credentials: grpc.ChannelCredentials | None = None, server_name: str | None = None,
            max_message_bytes: int = MAX_INTERNAL_MESSAGE_BYTES, aio: bool = False) -> grpc.Channel | grpc.aio.Channel:
    """A channel, with TLS when credentials are given; server_name is the name the server's
    certificate must carry when it differs from the address (workers register IPs). With `aio`, an
    asyncio channel (grpc.aio), to be used on the event loop that creates it."""
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes),
               # Its own connections: by default channels of a process to one address share them, so a
               # new channel to a worker restarted at the same address could inherit the dead process's
               # connection in reconnect backoff and fail "Connection refused" (ChannelCache).
               ("grpc.use_local_subchannel_pool", 1),
               *KEEPALIVE_OPTIONS]
    api = grpc.aio if aio else grpc
    if credentials is None:
        return api.insecure_channel(address, options=options)
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return api.secure_channel(address, credentials, options=options)


class ChannelCache:
    """Channels to peers, one per (address, epoch), reused across calls.

    Peer addresses come and go with pods, so idle channels beyond `max_idle` are closed, least
    recently used first; a channel in use (inside `use()`) is never closed. A worker restarted at the
    same address has a new epoch and gets a new channel, with connections of its own (`channel()`): the
    old one may be in gRPC's reconnect backoff after failing to reach the dead process, and would refuse
    calls for seconds after the new one is up (a killed and restarted decode worker saw its pushes fail
    "Connection refused" that way). Idle channels of the address's other epochs are closed then.

    With `tls` (a security.ClientTLS), a channel is opened with the TLS files of the moment: once they are
    re-read (a rotation), the next use opens a new channel, and calls in flight on the old one finish there.
    """

    def __init__(self, *, tls=None, max_idle: int = 16):
        self._tls = tls
        self.max_idle = max_idle
        # (address, epoch, TLS generation) -> channel, least recently used first
        self._channels: dict[tuple[str, str, int], grpc.Channel] = {}
        self._users: collections.Counter[tuple[str, str, int]] = collections.Counter()  # calls in flight per key
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def use(self, address: str, epoch: str = "") -> Iterator[grpc.Channel]:
        credentials, generation = self._tls.credentials() if self._tls is not None else (None, 0)
        key = (address, epoch, generation)
        with self._lock:
            ch = self._channels.pop(key, None)
            if ch is None:
                for old in [k for k in self._channels if k[0] == address and k not in self._users]:
                    self._discard(self._channels.pop(old))
                ch = self._open(address, credentials)
            self._channels[key] = ch
            self._users[key] += 1
        try:
            yield ch
        finally:
            with self._lock:
                self._users[key] -= 1
                if not self._users[key]:
                    del self._users[key]
                idle = [k for k in self._channels if k not in self._users]
                for k in idle[:max(0, len(idle) - self.max_idle)]:
                    self._discard(self._channels.pop(k))

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                self._discard(ch)
            self._channels.clear()

    def _open(self, address: str, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
        return channel(address, credentials=credentials, server_name=self._tls.server_name if self._tls else None)

    def _discard(self, ch: grpc.Channel) -> None:
        ch.close()


class AioChannelCache(ChannelCache):
    """A ChannelCache of asyncio channels, used on the event loop that runs `use()`. An aio channel
    closes asynchronously: `aclose()` closes them all and waits until they are."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self._closing: set[asyncio.Task] = set()

    async def aclose(self) -> None:
        self.close()
        await asyncio.gather(*self._closing)

    def _open(self, address: str, credentials: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
        return channel(address, credentials=credentials, server_name=self._tls.server_name if self._tls else None,
                       aio=True)

    def _discard(self, ch: grpc.aio.Channel) -> None:
        task = asyncio.get_running_loop().create_task(ch.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
