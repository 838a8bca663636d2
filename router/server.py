"""The router's gRPC server: the public Generate API with health and reflection."""
from __future__ import annotations

import logging
import threading
import time
import uuid

from common import grpc_util, security
from common.engine.models import resolve_model_path
from common.state import StateStore, StateUnavailable
from common.engine.tokenizer import load_tokenizer
from common.engine.weights import read_model_config, weights_id_of
from protos import handoff_pb2_grpc
from router.config import RouterConfig
from router.http_server import HTTPServer
from router.service import Router, RouterServicer

log = logging.getLogger(__name__)

SERVICE_NAMES = ["handoff.v1.Router"]


class RouterServer:
    def __init__(self, config: RouterConfig, state: StateStore):
        self.config = config
        self.state = state
        self.port = 0
        self.http_port = 0  # the OpenAI-compatible HTTP API's, when on
        self.http: HTTPServer | None = None
        self.health_server = None
        self._ready = threading.Event()
        self._serving = threading.Event()  # /health on the HTTP port: ready and not stopping
        self._stop = threading.Event()
        # New at every start: a restarted router is a new one, and the old one's requests get reaped.
        self.router_id = f"router-{uuid.uuid4().hex[:12]}"

    def start(self) -> "RouterServer":
        cfg = self.config
        credentials = security.server_credentials(cfg.tls, require_client_cert=cfg.tls.require_client_cert)
        keys = security.APIKeys(cfg.api_keys)
        if keys.enabled and credentials is None:
            log.warning("API keys are on but TLS is off: keys cross the network in plaintext")
        path = resolve_model_path(self.config.model)
        # The router needs the tokenizer and the model's shape, never the weights themselves.
        self.router = Router(self.config, self.state, load_tokenizer(path), read_model_config(path),
                             weights_id_of(path), router_id=self.router_id)
        self.server = grpc_util.make_server(
            cfg.server_threads, max_message_bytes=grpc_util.MAX_PUBLIC_MESSAGE_BYTES,
            interceptors=(security.APIKeyInterceptor(keys),) if keys.enabled else ())
        self.health = grpc_util.add_health_and_reflection(self.server, SERVICE_NAMES)
        handoff_pb2_grpc.add_RouterServicer_to_server(RouterServicer(self.router), self.server)
        self.port = grpc_util.bind(self.server, cfg.host, cfg.port, credentials, flag="--port")
        self.server.start()
        if cfg.http_port >= 0:
            self.http = HTTPServer(self.router, keys, is_ready=self._serving.is_set).start()
            self.http_port = self.http.port
        if cfg.health_port:
            self.health_server = grpc_util.serve_health(self.health, cfg.host, cfg.health_port)
        threading.Thread(target=self._become_ready, name="router-ready", daemon=True).start()
        self._heartbeat = threading.Thread(target=self._beat, name="router-heartbeat", daemon=True)
        self._heartbeat.start()
        tls = ("plaintext" if credentials is None else
               "TLS, client certificates required" if cfg.tls.require_client_cert else "TLS")
        log.info("router listening on %s:%d (%s; %s)%s", cfg.host, self.port, tls,
                 f"{len(keys)} API keys" if keys.enabled else "no API key needed",
                 f", OpenAI-compatible HTTP on :{self.http_port}" if self.http else "")
        return self

    def _become_ready(self) -> None:
        # SERVING once Redis answers; workers may come later (requests then queue briefly).
        while not self._ready.is_set():
            try:
                self.state.ping()
                grpc_util.set_serving(self.health, SERVICE_NAMES, True)
                self._serving.set()
                self._ready.set()
            except StateUnavailable as exc:
                log.warning("waiting for Redis: %s", exc)
                time.sleep(0.5)

    def _beat(self) -> None:
        """Keeps this router registered (its requests' records are ended by others if it dies) and
        ends the records of routers that died."""
        cfg = self.config
        while not self._stop.wait(cfg.heartbeat_s):
            try:
                self.state.router_heartbeat(self.router_id, cfg.heartbeat_ttl_s)
                for router_id, num_ended in self.state.reap_routers().items():
                    log.warning("router %s is gone: ended its %d requests still in flight", router_id, num_ended)
            except Exception as exc:  # noqa: BLE001 - the heartbeat must outlive any error
                log.warning("router heartbeat failed, will keep trying: %s", exc,
                            exc_info=not isinstance(exc, StateUnavailable))

    def stop(self, grace_s: float = 25.0) -> None:
        self._ready.set()
        self._serving.clear()
        grpc_util.set_serving(self.health, SERVICE_NAMES, False)
        stopped = self.server.stop(grace=grace_s)  # both ports drain at once
        if self.http is not None:
            self.http.stop(grace_s)
        stopped.wait()
        self._stop.set()
        self._heartbeat.join(timeout=5)
        try:
            self.state.deregister_router(self.router_id)
        except StateUnavailable as exc:
            log.warning("could not deregister (the entry expires by itself): %s", exc)
        if self.health_server is not None:
            self.health_server.stop(grace=None)
        self.router.close()
