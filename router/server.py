"""The router's servers: the public Generate API (gRPC, with health and reflection) and the OpenAI-compatible
HTTP API, on one asyncio event loop.

Threads: the loop runs on one thread of its own ("router-loop") and holds every stream of both ports:
gRPC is served by grpc.aio, HTTP by uvicorn as a task on the same loop, and every request is a
coroutine there (router/generate.py), as is each decode session's reader (router/decode_sessions.py), so a
stream in flight, waiting for tokens or queued for KV, costs no thread. Besides the loop the router
has a few threads whatever its load: the blocking pool (`blocking_threads`) for Redis calls and
tokenization, the lease keeper and the heartbeat. `start()` and `stop()` may be called from any
thread; they wait for the loop.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid

from common import grpc_aio_server, grpc_common, security
from common.engine.generation_config import sampling_defaults
from common.engine.model_files import resolve_model_path
from common.state import StateStore, StateUnavailable
from common.engine.tokenizer import load_tokenizer
from common.engine.weights import read_model_config, weights_id_of
from protos import handoff_pb2_grpc
from router.config import RouterConfig
from router.http_front import HTTPServer
from router.generate import Router, RouterServicer

log = logging.getLogger(__name__)

SERVICE_NAMES = ["handoff.v1.Router"]


class RouterServer:
    def __init__(self, config: RouterConfig, state: StateStore):
        self.config = config
        self.state = state
        self.port = 0
        self.http_port = 0  # the OpenAI-compatible HTTP API's, when on
        self.http: HTTPServer | None = None
        self.server = None
        self.health_server = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._serving = threading.Event()  # /health on the HTTP port: ready and not stopping
        self._stop = threading.Event()
        # New at every start: a restarted router is a new one, and the old one's requests get reaped.
        self.router_id = f"router-{uuid.uuid4().hex[:12]}"

    def start(self) -> "RouterServer":
        cfg = self.config
        path = resolve_model_path(self.config.model)
        # The router needs the tokenizer and the model's shape, never the weights themselves.
        self.sampling_defaults = sampling_defaults(path) if cfg.generation_config == "auto" else {}
        if self.sampling_defaults:
            log.info("request defaults from the model's files (--generation-config auto): %s",
                     ", ".join(f"{k} {v}" for k, v in self.sampling_defaults.items()))
        self.router = Router(self.config, self.state, load_tokenizer(path), read_model_config(path),
                             weights_id_of(path), router_id=self.router_id, sampling_defaults=self.sampling_defaults)
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="router-loop", daemon=True)
        self._loop_thread.start()
        try:
            credentials, keys = self._on_loop(self._start())
        except BaseException:
            self._on_loop(self._abandon())
            self._end_loop()
            raise
        self._heartbeat = threading.Thread(target=self._beat, name="router-heartbeat", daemon=True)
        self._heartbeat.start()
        tls = ("plaintext" if credentials is None else
               "TLS, client certificates required" if cfg.tls.require_client_cert else "TLS")
        log.info("router listening on %s:%d (%s; %s)%s", cfg.host, self.port, tls,
                 f"{len(keys)} API keys" if keys.enabled else "no API key needed",
                 f", OpenAI-compatible HTTP on :{self.http_port} (model {', '.join(self.http.api.model_names)})"
                 if self.http else "")
        return self

    def _on_loop(self, coro):
        """Run a coroutine on the router's loop from another thread; its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _start(self):
        cfg = self.config
        # The public port serves --public-tls-cert (the router's own certificate without one).
        credentials = security.server_credentials(cfg.tls.public, require_client_cert=cfg.tls.require_client_cert)
        # Keys from a file are re-read when it changes (or on SIGHUP): rotated without a restart.
        keys = (security.APIKeyFile(cfg.api_keys_file, ",".join(cfg.api_keys_env)) if cfg.api_keys_file
                else security.APIKeys(cfg.api_keys))
        if keys.enabled and credentials is None:
            log.warning("API keys are on but TLS is off: keys cross the network in plaintext")
        self.server = grpc_aio_server.make_server(
            cfg.max_streams, max_message_bytes=grpc_common.MAX_PUBLIC_MESSAGE_BYTES,
            interceptors=(security.APIKeyInterceptor(keys),) if keys.enabled else ())
        self.health = await grpc_aio_server.add_health_and_reflection(self.server, SERVICE_NAMES)
        handoff_pb2_grpc.add_RouterServicer_to_server(RouterServicer(self.router), self.server)
        self.port = grpc_common.bind(self.server, cfg.host, cfg.port, credentials, flag="--port")
        await self.server.start()
        if cfg.http_port >= 0:
            self.http = await HTTPServer(self.router, keys, is_ready=self._serving.is_set).start()
            self.http_port = self.http.port
        if cfg.health_port:
            self.health_server = await grpc_aio_server.serve_health(self.health, cfg.host, cfg.health_port)
        self._ready = asyncio.create_task(self._become_ready())
        return credentials, keys

    async def _become_ready(self) -> None:
        # SERVING once Redis answers; workers may come later (requests then queue briefly).
        while True:
            try:
                await self.router.blocking.run(self.state.ping)
                break
            except StateUnavailable as exc:
                log.warning("waiting for Redis: %s", exc)
                await asyncio.sleep(0.5)
        await grpc_aio_server.set_serving(self.health, SERVICE_NAMES, True)
        self._serving.set()

    def _beat(self) -> None:
        """Keeps this router registered (its requests' records are ended by others if it dies) and
        ends the records of routers that died."""
        cfg = self.config
        next_beat = time.monotonic() + cfg.heartbeat_s
        # Beats start every heartbeat_s, not heartbeat_s after the last one ended: after a call that timed out
        # (the Redis socket timeout) the next goes at once, so one slow answer never costs more than the
        # socket timeout plus one beat of the registration's TTL.
        while not self._stop.wait(max(0.0, next_beat - time.monotonic())):
            next_beat = time.monotonic() + cfg.heartbeat_s
            try:
                self.state.router_heartbeat(self.router_id, cfg.heartbeat_ttl_s)
                for router_id, num_ended in self.state.reap_routers().items():
                    log.warning("router %s is gone: ended its %d requests still in flight", router_id, num_ended)
            except Exception as exc:  # noqa: BLE001 - the heartbeat must outlive any error
                log.warning("router heartbeat failed, will keep trying: %s", exc,
                            exc_info=not isinstance(exc, StateUnavailable))

    def stop(self, grace_s: float = 25.0) -> None:
        """Stop taking requests; those in flight may finish within grace_s, then they are cancelled."""
        self._on_loop(self._drain(grace_s))
        self._stop.set()
        self._heartbeat.join(timeout=5)
        try:
            num_unrecorded = self.state.deregister_router(self.router_id)
            if num_unrecorded:
                log.warning("%d requests' ends could not be recorded (Redis refused them); recorded them failed",
                            num_unrecorded)
        except StateUnavailable as exc:
            log.warning("could not deregister (the entry expires by itself): %s", exc)
        self._on_loop(self._close_loop())
        self._end_loop()
        # grpc.aio keeps a poller thread until its last server and channel are freed; with it running a
        # fork that runs Python in the child (a subprocess with a preexec_fn) can crash the child.
        self.server = self.health_server = None

    async def _drain(self, grace_s: float) -> None:
        self._ready.cancel()
        self._serving.clear()
        await grpc_aio_server.set_serving(self.health, SERVICE_NAMES, False)
        # Both ports drain at once.
        await asyncio.gather(self.server.stop(grace_s), *([self.http.stop(grace_s)] if self.http else []))
        if self.health_server is not None:
            await self.health_server.stop(None)
        await self.router.close()

    async def _abandon(self) -> None:
        """After a failed start: close what did start."""
        if self.server is not None:
            await self.server.stop(None)
        if self.http is not None:
            await self.http.stop(0)
        await self.router.close()
        await self._close_loop()

    async def _close_loop(self) -> None:
        """Whatever is still scheduled on the loop (nothing, after a clean stop) is cancelled."""
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.loop.shutdown_asyncgens()

    def _end_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(timeout=5)
        self.loop.close()
