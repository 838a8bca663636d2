"""The router's OpenAI-compatible HTTP port: Starlette on uvicorn, in front of the same GenerateCall as gRPC.

    POST /v1/completions, POST /v1/chat/completions   (JSON, or server-sent events with "stream": true)
    GET  /v1/models, GET /health      (metrics are on --metrics-port, never on this public port)

A request is parsed (router/openai_schema.py), validated by the router's RequestValidator and served by one
GenerateCall per choice, exactly as Generate serves a gRPC call: records in Redis, leases, failover,
deadlines. The HTTP client going away cancels it like a cancelled gRPC call.

Threads: none per request. uvicorn serves this app as a task on the router's event loop (router/server.py),
next to the gRPC server, and each generation is a GenerateCall coroutine on that loop, as a gRPC call's
is; its messages reach the response through an asyncio queue. A request that would take the port past
`max_streams` generations in flight is refused at once (429), as the gRPC port refuses a call beyond
its limit.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import re
import socket
import ssl
import time
import uuid
from dataclasses import replace

import grpc
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from common import metrics, security, tracing
from common.engine.model_files import served_name
from common.engine.sampling import MAX_SEED, derive_seed
from common.grpc_common import PortInUse, ServiceError
from protos import handoff_pb2
from router import openai_schema
from router.openai_schema import APIError, ParsedRequest, ResponseBuilder
from router.generate import GenerateCall, Router, internal_error
from router.validate import ValidRequest

log = logging.getLogger(__name__)

TIMEOUT_HEADER = "x-request-timeout"  # seconds the whole request may take; the gRPC deadline's counterpart
REQUEST_ID_HEADER = "x-request-id"  # a caller-chosen request id, as GenerateRequest.request_id
CLIENT_GONE = 499  # (nginx's) status for the metrics when the client left before its answer


class _Slots:
    """Generations in flight on this port, bounded; taken by a request, given back as each generation ends."""

    def __init__(self, total: int):
        self.total = total
        self.used = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.total:
            return False
        self.used += n
        return True

    def give(self, n: int = 1) -> None:
        self.used -= n


_END = object()  # a choice's call ended (after its last message, or without one when cancelled)


class Generations:
    """The GenerateCalls of one HTTP request (one per choice), each a task on the loop. Their messages,
    failures and ends arrive in order on one asyncio queue as (choice, GenerateResponse | Exception | _END)."""

    def __init__(self, router: Router, reqs: list[ValidRequest], timeout_s: float, deadline: float, slots: _Slots,
                 trace_parent=None):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.timeout_s = timeout_s
        self.deadline = deadline  # time.monotonic() when the request must be over
        self.num_choices = len(reqs)
        self.request_ids = [req.request_id for req in reqs]
        self.client_gone = False
        self.num_open = len(reqs)
        self._slots = slots
        self._tasks = []
        for index, req in enumerate(reqs):
            task = asyncio.create_task(GenerateCall(router, req, deadline, trace_parent).run(
                functools.partial(self._put, index)))
            # A callback, not a finally: a task cancelled before it started runs none of its code.
            task.add_done_callback(functools.partial(self._ended, index))
            self._tasks.append(task)

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    async def _put(self, index: int, msg: handoff_pb2.GenerateResponse) -> None:
        self.queue.put_nowait((index, msg))

    def _ended(self, index: int, task: asyncio.Task) -> None:
        self._slots.give()
        error = None if task.cancelled() else task.exception()
        self.queue.put_nowait((index, _END if error is None else error))

    async def next(self) -> tuple[int, object]:
        index, item = await self.queue.get()
        if item is _END or isinstance(item, BaseException):
            self.num_open -= 1
        return index, item

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    def lost_client(self) -> None:
        self.client_gone = True
        self.cancel()


class OpenAIApp:
    """The routes and what they share: the router, the API keys, the generation slots."""

    def __init__(self, router: Router, keys: security.APIKeys, *, model_names: tuple[str, ...], is_ready):
        cfg = router.config
        self.router = router
        self.keys = keys
        self.model_names = model_names  # what a request's "model" may be; responses report the first
        self.is_ready = is_ready  # () -> bool: /health's answer
        self.max_body_bytes = cfg.max_body_bytes
        self.body_timeout_s = cfg.body_timeout_s
        self.slots = _Slots(cfg.max_streams)
        self.created = int(time.time())
        self.fingerprint = f"fp_{router.weights_id[:16]}"
        self.token_text = openai_schema.TokenText(router.tokenizer)
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ], exception_handlers={404: self._no_route, 405: self._no_route})

    # ---- routes

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def models(self, request: Request) -> Response:
        try:
            self._authenticate(request)
        except APIError as exc:
            return self._error(request, exc)
        body = openai_schema.models_list(self.model_names, self.created, self.router.model_config.max_position)
        return self._respond(request, JSONResponse(body))

    async def health(self, request: Request) -> Response:
        ready = self.is_ready()
        return self._respond(request, JSONResponse({"status": "ok" if ready else "not serving"},
                                                   status_code=200 if ready else 503))

    async def _no_route(self, request: Request, exc) -> Response:
        status = getattr(exc, "status_code", 404)
        what = "no such route" if status == 404 else f"{request.method} is not allowed here"
        return self._error(request, APIError(status, f"{what}: {request.method} {request.url.path}"))

    # ---- generation

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        try:
            self._authenticate(request)
            # Admission before the body: a full port refuses at the headers, without reading (and holding) it.
            if self.slots.used >= self.slots.total:
                raise _port_full(self.slots.total)
            # The whole request's deadline from its arrival, as a gRPC deadline bounds a Generate call.
            timeout_s = min(_timeout_s(request) or math.inf, self.router.config.max_request_s)
            deadline = time.monotonic() + timeout_s
            body = await self._json_body(request, deadline)
            parsed = openai_schema.parse_request(body, chat=chat, model_names=self.model_names)
            response_id = request.headers.get(REQUEST_ID_HEADER) or \
                f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            gens = await self._start(request, parsed, response_id, timeout_s, deadline)
        except APIError as exc:
            return self._error(request, exc)
        except Exception:  # noqa: BLE001 - a bug answers 500, never a dropped connection
            log.exception("%s %s failed", request.method, request.url.path)
            return self._error(request, APIError(500, internal_error(request.headers.get(REQUEST_ID_HEADER, ""))))
        builder = ResponseBuilder(parsed, response_id=response_id, created=int(time.time()), model=self.model_names[0],
                                  fingerprint=self.fingerprint, token_text=self.token_text)
        watcher = asyncio.create_task(_watch_disconnect(request, gens))
        streaming = False
        try:
            if parsed.stream:
                first = await self._first_messages(gens)
                streaming = True  # from here the stream's own close cancels what is left
                return self._respond(request, _EventStream(self._events(gens, builder, first), gens.cancel,
                                                           headers={"X-Request-Id": response_id}))
            choices = await self._all_messages(gens)
            return self._respond(request, JSONResponse(builder.response(choices),
                                                       headers={"X-Request-Id": response_id}))
        except APIError as exc:
            return self._error(request, exc)
        finally:
            watcher.cancel()
            if not streaming:  # after a failure, or this task cancelled (the server stopping): stop what runs
                gens.cancel()

    async def _start(self, request: Request, parsed: ParsedRequest, request_id: str, timeout_s: float,
                     deadline: float) -> Generations:
        """Validate (on the blocking pool: chat templates and tokenization are CPU work) and start every choice."""
        n = parsed.n
        if n > 1 and len(request_id) + 1 + len(str(n - 1)) > 128:
            raise openai_schema.bad_param(None, f"{REQUEST_ID_HEADER} is too long to name {n} choices")
        if not self.slots.take(n):
            raise _port_full(self.slots.total)
        started = False
        try:
            pb = handoff_pb2.GenerateRequest()
            pb.CopyFrom(parsed.request)
            pb.request_id = request_id
            try:
                valid = await self.router.validate(pb)
            except ValueError as exc:
                message = str(exc)
                if message.startswith("structured_output") and parsed.constraint_param:
                    # Named as the body named it: response_format, structured_outputs or a guided_* extra.
                    message = parsed.constraint_param + message[len("structured_output"):]
                    raise openai_schema.bad_param(parsed.constraint_param, message) from None
                raise APIError.from_status(grpc.StatusCode.INVALID_ARGUMENT, message) from None
            # A caller's traceparent header makes each choice's generation a part of its trace.
            gens = Generations(self.router, _choices(valid, n, seeded=pb.HasField("seed")), timeout_s, deadline,
                               self.slots, tracing.extract(request.headers))
            started = True
            return gens
        finally:
            if not started:
                self.slots.give(n)

    async def _all_messages(self, gens: Generations) -> list[list[handoff_pb2.GenerateResponse]]:
        """Every choice's messages, once all have ended; the first failure (the caller cancels the others)."""
        choices: list[list[handoff_pb2.GenerateResponse]] = [[] for _ in range(gens.num_choices)]
        while gens.num_open:
            index, item = await gens.next()
            if isinstance(item, handoff_pb2.GenerateResponse):
                choices[index].append(item)
            elif item is not _END or not _finished(choices[index]):
                # The caller cancels the others.
                raise self._failure(gens, index, item)
        return choices

    async def _first_messages(self, gens: Generations) -> list[tuple[int, object]]:
        """A stream's status comes with its headers: wait until every choice has a first message (its
        first token) or one failed (then the answer is that failure's status, not a broken 200)."""
        seen: list[tuple[int, object]] = []
        started: set[int] = set()
        while len(started) < gens.num_choices:
            index, item = await gens.next()
            if isinstance(item, handoff_pb2.GenerateResponse):
                started.add(index)
            elif item is not _END or index not in started:
                raise self._failure(gens, index, item)
            seen.append((index, item))
        return seen

    async def _events(self, gens: Generations, builder: ResponseBuilder, first: list[tuple[int, object]]):
        """The server-sent events of a stream: chunks, the usage chunk if asked, `data: [DONE]`. A failure
        after the first token can only be told in the stream: an error event (the openai client raises it)."""
        finals: list[handoff_pb2.GenerateResponse | None] = [None] * gens.num_choices

        async def items():
            for item in first:
                yield item
            while gens.num_open:
                yield await gens.next()

        async for index, item in items():
            if isinstance(item, handoff_pb2.GenerateResponse):
                if item.finish_reason:
                    finals[index] = item
                chunk = builder.chunk(index, item)
                if chunk is not None:
                    yield _sse(chunk)
            elif item is not _END or finals[index] is None:
                gens.cancel()
                yield _sse(self._failure(gens, index, item).body())
                break
        else:
            if builder.include_usage:
                yield _sse(builder.usage_chunk(finals))
        yield "data: [DONE]\n\n"

    def _failure(self, gens: Generations, index: int, item: object) -> APIError:
        """Why choice `index` ended without its answer, as an OpenAI error."""
        if gens.client_gone:
            return APIError(CLIENT_GONE, "the client closed the connection")
        if gens.expired:
            return APIError(504, f"the request ran past its deadline of {gens.timeout_s:g} s ({TIMEOUT_HEADER}, "
                                 f"capped by the router's max_request_s)")
        if isinstance(item, ServiceError):
            return APIError.from_status(item.code, item.message)
        if isinstance(item, ValueError):
            return APIError.from_status(grpc.StatusCode.INVALID_ARGUMENT, str(item))
        if isinstance(item, BaseException):
            log.error("HTTP generation failed", exc_info=item)
            return APIError(500, internal_error(gens.request_ids[index]))
        return APIError(500, "the generation ended without an answer")

    # ---- plumbing

    def _authenticate(self, request: Request) -> None:
        if not self.keys.enabled:
            return
        token = security.bearer_token(request.headers.items())
        if token and self.keys.check(token):
            return
        message = ("this API requires an API key: send the header 'Authorization: Bearer <key>'" if token is None
                   else "the Authorization header must be 'Bearer <key>'" if token == ""
                   else "the API key is not valid")
        raise APIError(401, message, headers={"WWW-Authenticate": "Bearer"})

    async def _json_body(self, request: Request, deadline: float):
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            raise _too_large(self.max_body_bytes)
        chunks, size = [], 0
        # A body that stops arriving must not hold its connection (and a slot of max_streams) for good.
        timeout_s = min(self.body_timeout_s, max(0.0, deadline - time.monotonic()))
        try:
            async with asyncio.timeout(timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        raise _too_large(self.max_body_bytes)
                    chunks.append(chunk)
        except ClientDisconnect:
            raise APIError(CLIENT_GONE, "the client closed the connection while sending the request") from None
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {timeout_s:g} s",
                           headers={"Connection": "close"}) from None
        raw = b"".join(chunks)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
            raise openai_schema.bad_param(None, f"the request body is not valid JSON: {exc}") from None
        if _SURROGATE_ESCAPE.search(raw):  # UTF-8 cannot hold a surrogate: only an escape makes one
            _check_text(body)
        return body

    def _error(self, request: Request, exc: APIError) -> Response:
        if exc.status >= 500 and exc.status != CLIENT_GONE:
            log.warning("%s %s: %d %s", request.method, request.url.path, exc.status, exc.message)
        return self._respond(request, JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers))

    def _respond(self, request: Request, response: Response) -> Response:
        route = request.url.path if request.url.path in _ROUTES else "other"
        metrics.HTTP_RESPONSES.labels(route, str(response.status_code)).inc()
        return response


_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"}


def _choices(valid: ValidRequest, n: int, *, seeded: bool) -> list[ValidRequest]:
    """n independent generations of one validated request: seeds seed, seed + 1, ... when the caller gave
    one (so n choices are reproducible), else one drawn for each; request ids <id>-0, <id>-1, ..."""
    if n == 1:
        return [valid]
    seeds = [(valid.seed + i) % (MAX_SEED + 1) if seeded else derive_seed(None) for i in range(n)]
    return [replace(valid, request_id=f"{valid.request_id}-{i}", seed=seed,
                    params=replace(valid.params, seed=seed if seeded else None))
            for i, seed in enumerate(seeds)]


def _finished(msgs: list[handoff_pb2.GenerateResponse]) -> bool:
    return bool(msgs) and msgs[-1].finish_reason != handoff_pb2.FINISH_REASON_UNSPECIFIED


def _timeout_s(request: Request) -> float | None:
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise openai_schema.bad_param(None, f"the {TIMEOUT_HEADER} header must be a positive number of seconds, "
                                         f"got {raw!r}")
    return value


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes")


def _port_full(total: int) -> APIError:
    return APIError(429, f"this router is serving {total} generations already; retry shortly",
                    headers={"Retry-After": "1"})


_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _check_text(body) -> None:
    """400 naming the parameter for a string that holds a lone UTF-16 surrogate: JSON may escape one
    ("\\ud800"), but it is no Unicode text, and encoding it (for the GenerateRequest, the tokenizer) fails.
    Iterative: the body may nest as deep as json.loads allows."""
    todo = [(body, None)]
    while todo:
        value, path = todo.pop()
        if isinstance(value, str):
            bad = None if value.isascii() else _SURROGATE.search(value)
            if bad is not None:
                raise openai_schema.bad_param(path, f"{path or 'the request body'} is not valid Unicode text: it "
                                                    f"holds a lone UTF-16 surrogate (\\u{ord(bad.group()):04x})")
        elif isinstance(value, dict):
            for key, item in value.items():
                todo.append((key, path))
                todo.append((item, key if path is None else f"{path}.{key}"))
        elif isinstance(value, list):
            todo.extend((item, f"{path or ''}[{i}]") for i, item in enumerate(value))


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _watch_disconnect(request: Request, gens: Generations) -> None:
    """Cancel the generations when the client disconnects (the body is read: what comes now is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    gens.lost_client()


class _EventStream(StreamingResponse):
    """A text/event-stream response that runs `on_close` however it ends: finished, client gone (Starlette
    then cancels the stream), server stopping."""

    media_type = "text/event-stream"

    def __init__(self, content, on_close, headers: dict[str, str]):
        super().__init__(content, headers={"Cache-Control": "no-cache", **headers})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class HTTPServer:
    """uvicorn serving OpenAIApp as a task on the router's event loop, started and stopped with the gRPC server."""

    def __init__(self, router: Router, keys: security.APIKeys, *, is_ready):
        self.config = cfg = router.config
        model_names = cfg.served_model_names or (served_name(cfg.model),)
        self.api = OpenAIApp(router, keys, model_names=model_names, is_ready=is_ready)
        self.port = 0
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> "HTTPServer":
        cfg = self.config
        sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((cfg.host, cfg.http_port))
        except OSError:
            sock.close()
            raise PortInUse(f"cannot listen on {cfg.host}:{cfg.http_port}: another process uses it; choose "
                            f"another with --http-port (0 picks a free one, -1 turns HTTP off)") from None
        self.port = sock.getsockname()[1]
        tls = cfg.tls.public  # the public certificate (--public-tls-cert), as on the gRPC port
        config = uvicorn.Config(
            self.api.app, log_level="warning", access_log=False, http="h11", loop="none", ws="none",
            lifespan="off", timeout_graceful_shutdown=cfg.drain_timeout_s,
            # Connections, open or idle, beyond the generations the port serves are refused (503) at once.
            limit_concurrency=cfg.max_streams,
            ssl_certfile=tls.cert, ssl_keyfile=tls.key,
            ssl_ca_certs=tls.ca if tls.require_client_cert else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls.require_client_cert else ssl.CERT_NONE)
        config.load()
        if config.ssl is not None:  # certificates re-read when they change, as on the gRPC port
            security.rotating_ssl_context(config.ssl, tls, require_client_cert=tls.require_client_cert)
        self._server = uvicorn.Server(config)
        # Off the main thread uvicorn installs no signal handlers: the router's owner handles signals.
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="router-http")
        deadline = time.monotonic() + 30
        while not self._server.started:
            if self._task.done() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server on port {self.port} did not start (see the log)")
            await asyncio.sleep(0.01)
        return self

    async def stop(self, grace_s: float) -> None:
        """Stop taking connections; streams in flight may finish within grace_s, then they are cancelled."""
        if self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = grace_s
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), grace_s + 5)
        except asyncio.TimeoutError:
            self._task.cancel()
            log.warning("the HTTP server did not stop within %.0f s of its grace period", grace_s + 5)
