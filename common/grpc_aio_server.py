"""The asyncio (grpc.aio) counterparts of grpc_common's server helpers, for a server whose handlers are
coroutines on one event loop (the router's): the error interceptor, health and reflection, the
plaintext health port.

Every function here runs on that event loop. The statuses and messages are grpc_common's: a client
cannot tell an aio server from a threaded one.
"""
from __future__ import annotations

import inspect

import grpc
from grpc_health.v1 import _async as health_aio, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common import grpc_common
from common.grpc_common import KEEPALIVE_OPTIONS, LIVENESS, ServiceError, lenient, parsed, reported

HealthServicer = health_aio.HealthServicer


async def _parsed_stream(requests):
    async for request in requests:
        yield parsed(request)


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    code, message = reported(method, exc)
    if isinstance(exc, ServiceError) and exc.trailers:
        context.set_trailing_metadata(exc.trailers)
    await context.abort(code, message)


def _guard(behavior, parse, method: str):
    """`behavior` with its exceptions turned into statuses; of the same kind (a coroutine function, or an
    async generator function for a response stream that yields), as grpc.aio tells them apart."""
    if inspect.isasyncgenfunction(behavior):
        async def streamed(request, context):
            try:
                async for response in behavior(parse(request), context):
                    yield response
            except Exception as exc:  # noqa: BLE001 - every failure becomes a status; aborts pass as they are
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                await _abort(context, method, exc)
        return streamed

    async def awaited(request, context):
        try:
            return await behavior(parse(request), context)
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await _abort(context, method, exc)
    return awaited


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """grpc_common.ErrorInterceptor for coroutine handlers: any exception a handler raises becomes a gRPC
    status with a readable message, and a request that does not parse INVALID_ARGUMENT."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        handler = handler._replace(request_deserializer=lenient(handler.request_deserializer))
        for kind, parse in (("unary_unary", parsed), ("unary_stream", parsed),
                            ("stream_unary", _parsed_stream), ("stream_stream", _parsed_stream)):
            behavior = getattr(handler, kind)
            if behavior:
                return handler._replace(**{kind: _guard(behavior, parse, method)})
        return handler


def make_server(max_rpcs: int, *, max_message_bytes: int,
                interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()) -> grpc.aio.Server:
    """An asyncio server on the running event loop: no thread per call. `interceptors` run before the error
    interceptor (authentication refuses a call first); beyond `max_rpcs` calls in flight gRPC answers
    RESOURCE_EXHAUSTED at once."""
    return grpc.aio.server(
        interceptors=[*interceptors, ErrorInterceptor()],
        maximum_concurrent_rpcs=max_rpcs,
        options=[("grpc.max_receive_message_length", max_message_bytes),
                 ("grpc.max_send_message_length", max_message_bytes),
                 ("grpc.so_reuseport", 0), *KEEPALIVE_OPTIONS],
    )


async def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> HealthServicer:
    """grpc_common.add_health_and_reflection for an aio server: grpc.health.v1 (NOT_SERVING until the caller
    says ready, `liveness` SERVING) and server reflection."""
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await set_serving(health_servicer, service_names, False)
    await health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    # Given an aio server, reflection serves with its asyncio servicer.
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME], server)
    return health_servicer


async def set_serving(health_servicer: HealthServicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await health_servicer.set(name, status)


async def serve_health(health_servicer: HealthServicer, host: str, port: int) -> grpc.aio.Server:
    """grpc_common.serve_health on the event loop: a plaintext server with only grpc.health.v1 (the same
    servicer, so the same status), for the kubelet's probe, which cannot speak TLS."""
    server = grpc.aio.server(maximum_concurrent_rpcs=8, options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    grpc_common.bind(server, host, port, flag="--health-port")
    await server.start()
    return server
