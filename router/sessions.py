"""The router's side of DecodeSession: one long-lived stream per decode worker for all of its requests.

`DecodeSessions.start()` hands back a `SessionCall` that reads like the gRPC call of Decode it
replaces (iterate it for DecodeEvents; it raises grpc.RpcError with a code and details; cancel()),
so GenerateCall's relay, blame and failover logic is the same for both. One reader thread per
session routes each message's events to the calls they belong to.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

import grpc

from common import grpc_util
from common.state import WorkerInfo
from protos import internal_pb2, internal_pb2_grpc

log = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}


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
        self.events: queue.SimpleQueue = queue.SimpleQueue()  # DecodeEvent | SessionError
        self._closed = False  # no longer routed to (ended, failed or cancelled)
        self._finished = False  # its last DecodeEvent was returned
        self._error: SessionError | None = None  # raised again by every later next(), as gRPC does

    def __iter__(self):
        return self

    def __next__(self) -> internal_pb2.DecodeEvent:
        if self._finished:
            raise StopIteration
        if self._error is not None:
            raise self._error
        try:
            item = self.events.get(timeout=max(0.0, self.deadline - time.monotonic()))
        except queue.Empty:
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
        """Stop the request on the decode worker (its KV is freed there); next() then raises CANCELLED."""
        if self._closed:
            return
        self._close()
        self.session.send(internal_pb2.SessionRequest(cancel=internal_pb2.SessionCancel(
            request_id=self.key[0], attempt=self.key[1])))
        self.events.put(SessionError(grpc.StatusCode.CANCELLED, "cancelled"))

    def _close(self) -> None:
        self._closed = True
        self.session.forget(self)


class Session:
    """A DecodeSession stream to one decode worker (one epoch of it)."""

    def __init__(self, channel: grpc.Channel, worker: WorkerInfo):
        self.worker = worker
        self._channel = channel
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._calls: dict[tuple[str, int], SessionCall] = {}
        self._lock = threading.Lock()
        self.broken: SessionError | None = None
        self._stream = internal_pb2_grpc.DecodeWorkerStub(channel).DecodeSession(iter(self._requests.get, None))
        self._reader = threading.Thread(target=self._read, name=f"session-{worker.worker_id}", daemon=True)
        self._reader.start()

    def start(self, request: internal_pb2.DecodeRequest, deadline: float) -> SessionCall:
        call = SessionCall(self, request.request_id, request.attempt, deadline)
        with self._lock:
            if self.broken is None:
                self._calls[call.key] = call
            else:
                call.events.put(self.broken)
                return call
        self.send(internal_pb2.SessionRequest(start=request))
        return call

    def send(self, request: internal_pb2.SessionRequest) -> None:
        if self.broken is None:
            self._requests.put(request)

    def forget(self, call: SessionCall) -> None:
        with self._lock:
            if self._calls.get(call.key) is call:
                del self._calls[call.key]

    def _read(self) -> None:
        try:
            for msg in self._stream:
                with self._lock:
                    routed = [(self._calls.get((ev.request_id, ev.attempt)), ev) for ev in msg.events]
                for call, ev in routed:
                    if call is None:
                        continue  # cancelled or timed out here already
                    if ev.status_code:
                        call.events.put(SessionError(_CODES.get(ev.status_code, grpc.StatusCode.UNKNOWN),
                                                     ev.status_message))
                    else:
                        call.events.put(ev.event)
            error = SessionError(grpc.StatusCode.UNAVAILABLE,
                                 f"decode worker {self.worker.worker_id} ended its session")
        except grpc.RpcError as exc:
            error = SessionError(exc.code(), exc.details() or "the decode session broke")
        with self._lock:
            self.broken = error
            calls, self._calls = list(self._calls.values()), {}
        self._requests.put(None)  # ends the request iterator
        for call in calls:
            call.events.put(error)

    def close(self) -> None:
        self._stream.cancel()
        self._channel.close()


class DecodeSessions:
    """This router's sessions, one per decode worker epoch, opened on first use and again after a break."""

    def __init__(self, *, credentials: grpc.ChannelCredentials | None = None, server_name: str | None = None):
        self._credentials = credentials
        self._server_name = server_name
        self._sessions: dict[tuple[str, str], Session] = {}
        self._lock = threading.Lock()

    def start(self, worker: WorkerInfo, request: internal_pb2.DecodeRequest, deadline: float) -> SessionCall:
        return self._session(worker).start(request, deadline)

    def drop_kv(self, worker: WorkerInfo, request_id: str, attempt: int) -> None:
        """An attempt that will never decode: its KV, pushed or still to come, is dropped by the worker."""
        self._session(worker).send(internal_pb2.SessionRequest(cancel=internal_pb2.SessionCancel(
            request_id=request_id, attempt=attempt)))

    def _session(self, worker: WorkerInfo) -> Session:
        key = (worker.address, worker.epoch)
        with self._lock:
            # A broken session (worker gone, restarted) is replaced; those of other epochs of the same
            # address are dropped, so sessions do not pile up as pods come and go.
            for k, s in list(self._sessions.items()):
                if s.broken is not None or (k[0] == key[0] and k != key):
                    del self._sessions[k]
                    s.close()
            session = self._sessions.get(key)
            if session is None:
                channel = grpc_util.channel(worker.address, credentials=self._credentials,
                                            server_name=self._server_name)
                session = self._sessions[key] = Session(channel, worker)
            return session

    def close(self) -> None:
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        for s in sessions:
            s.close()
