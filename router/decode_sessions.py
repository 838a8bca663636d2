"""The router's side of DecodeSession: one long-lived stream per decode worker for all of its requests.

Everything here runs on the router's event loop (grpc.aio): a session is a bidi stream fed from a
queue and read by one task, which routes each message's events to the requests they belong to, so
requests waiting for tokens hold no thread. `DecodeSessions.start()` hands back a `SessionCall` that
reads like the aio call of Decode it replaces (`await read()` for DecodeEvents, `grpc.aio.EOF` after
the last; it raises grpc.RpcError with a code and details; cancel()), so GenerateCall's relay, blame
and failover logic is the same for both.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from common import grpc_common
from common.state import WorkerInfo
from protos import internal_pb2, internal_pb2_grpc

log = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}


async def get_before(queue: asyncio.Queue, deadline: float):
    """queue.get(), given up at `deadline` (time.monotonic()) with TimeoutError. Being cancelled always
    raises CancelledError and leaves the item queued, even when one arrives in the same turn of the loop:
    asyncio.wait_for on Python 3.11 returns that item and drops the cancellation, so a client that left
    mid-stream had its request decoded to the end (about one cancel in ten at 200 tokens/s)."""
    async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
        return await queue.get()


class SessionError(grpc.RpcError):
    """A request's failure on a session, shaped like the RpcError a Decode call would raise."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):
        return ()


class SessionCall:
    """One request on a session: its DecodeEvents, in order, until the last one."""

    def __init__(self, session: "Session", request_id: str, attempt: int, deadline: float):
        self.session = session
        self.key = (request_id, attempt)
        self.deadline = deadline
        self.events: asyncio.Queue = asyncio.Queue()  # DecodeEvent | SessionError
        self._closed = False  # no longer routed to (ended, failed or cancelled)
        self._finished = False  # its last DecodeEvent was returned
        self._error: SessionError | None = None  # raised again by every later read(), as gRPC does

    async def read(self) -> internal_pb2.DecodeEvent:
        """The next DecodeEvent; grpc.aio.EOF after the last one."""
        if self._finished:
            return grpc.aio.EOF
        if self._error is not None:
            raise self._error
        try:
            item = await get_before(self.events, self.deadline)
        except TimeoutError:
            self.cancel()
            item = SessionError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        if isinstance(item, SessionError):
            self._error = item
            self._close()
            raise item
        if item.HasField("finish_reason"):
            self._finished = True
            self._close()
        return item

    def cancel(self) -> None:
        """Stop the request on the decode worker (its KV is freed there); read() then raises CANCELLED."""
        if self._closed:
            return
        self._close()
        self.session.send(internal_pb2.SessionRequest(cancel=internal_pb2.SessionCancel(
            request_id=self.key[0], attempt=self.key[1])))
        self.events.put_nowait(SessionError(grpc.StatusCode.CANCELLED, "cancelled"))

    def _close(self) -> None:
        self._closed = True
        self.session.forget(self)


class Session:
    """A DecodeSession stream to one decode worker (one epoch of it)."""

    def __init__(self, channel: grpc.aio.Channel, worker: WorkerInfo):
        self.worker = worker
        self._channel = channel
        self._requests: asyncio.Queue = asyncio.Queue()  # SessionRequest, None to end the stream
        self._calls: dict[tuple[str, int], SessionCall] = {}
        self.broken: SessionError | None = None
        self._retiring = False  # replaced: closes once its last request has ended
        self._stream = internal_pb2_grpc.DecodeWorkerStub(channel).DecodeSession(self._outgoing())
        self.reader = asyncio.get_running_loop().create_task(self._read(), name=f"session-{worker.worker_id}")

    def start(self, request: internal_pb2.DecodeRequest, deadline: float) -> SessionCall:
        call = SessionCall(self, request.request_id, request.attempt, deadline)
        if self.broken is not None:
            call.events.put_nowait(self.broken)
            return call
        self._calls[call.key] = call
        self.send(internal_pb2.SessionRequest(start=request))
        return call

    def send(self, request: internal_pb2.SessionRequest) -> None:
        if self.broken is None:
            self._requests.put_nowait(request)

    def forget(self, call: SessionCall) -> None:
        if self._calls.get(call.key) is call:
            del self._calls[call.key]
        if self._retiring and not self._calls:
            self.close()

    def close_when_idle(self) -> None:
        """No new requests come here (a session with newer TLS files took over): end once the last one has."""
        self._retiring = True
        if not self._calls:
            self.close()

    async def _outgoing(self):
        while (request := await self._requests.get()) is not None:
            yield request

    async def _read(self) -> None:
        try:
            async for msg in self._stream:
                for ev in msg.events:
                    call = self._calls.get((ev.request_id, ev.attempt))
                    if call is None:
                        continue  # cancelled or timed out here already
                    if ev.status_code:
                        call.events.put_nowait(SessionError(_CODES.get(ev.status_code, grpc.StatusCode.UNKNOWN),
                                                            ev.status_message))
                    else:
                        call.events.put_nowait(ev.event)
            error = SessionError(grpc.StatusCode.UNAVAILABLE,
                                 f"decode worker {self.worker.worker_id} ended its session")
        except grpc.RpcError as exc:
            error = SessionError(exc.code(), exc.details() or "the decode session broke")
        except asyncio.CancelledError:  # close(): the router is stopping
            error = SessionError(grpc.StatusCode.UNAVAILABLE, "the router closed its decode session")
        self.broken = error
        calls, self._calls = list(self._calls.values()), {}
        self._requests.put_nowait(None)  # ends the request stream
        for call in calls:
            call.events.put_nowait(error)
        await self._channel.close()

    def close(self) -> None:
        """End the stream; the reader then fails what is left on it and closes the channel."""
        self._stream.cancel()

    async def aclose(self) -> None:
        self.close()
        await self.reader


class DecodeSessions:
    """This router's sessions, one per decode worker epoch, opened on first use and again after a break."""

    def __init__(self, *, tls=None):
        self._tls = tls  # a security.ClientTLS for decode workers, or None (plaintext)
        self._sessions: dict[tuple[str, str, int], Session] = {}
        self._closing: set[asyncio.Task] = set()  # readers of replaced sessions, until they end

    def start(self, worker: WorkerInfo, request: internal_pb2.DecodeRequest, deadline: float) -> SessionCall:
        return self._session(worker).start(request, deadline)

    def drop_kv(self, worker: WorkerInfo, request_id: str, attempt: int) -> None:
        """An attempt that will never decode: its KV, pushed or still to come, is dropped by the worker."""
        self._session(worker).send(internal_pb2.SessionRequest(cancel=internal_pb2.SessionCancel(
            request_id=request_id, attempt=attempt)))

    def _session(self, worker: WorkerInfo) -> Session:
        credentials, generation = self._tls.credentials() if self._tls is not None else (None, 0)
        key = (worker.address, worker.epoch, generation)
        # A broken session (worker gone, restarted) is replaced; those of other epochs of the same
        # address are dropped, so sessions do not pile up as pods come and go. After the TLS files are
        # re-read, new requests go on a new session; the old one is left to its requests in flight.
        for k, s in list(self._sessions.items()):
            if s.broken is not None or (k[0] == key[0] and k[1] != key[1]):
                self._retire(k)
            elif k[0] == key[0] and k != key:
                self._retire(k, once_idle=True)
        session = self._sessions.get(key)
        if session is None:
            channel = grpc_common.channel(worker.address, credentials=credentials,
                                          server_name=self._tls.server_name if self._tls else None, aio=True)
            session = self._sessions[key] = Session(channel, worker)
        return session

    def _retire(self, key: tuple[str, str, int], once_idle: bool = False) -> None:
        s = self._sessions.pop(key)
        if once_idle:
            s.close_when_idle()
        else:
            s.close()
        self._closing.add(s.reader)
        s.reader.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        await asyncio.gather(*(s.aclose() for s in sessions), *self._closing)
