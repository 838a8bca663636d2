"""The router's gRPC server: the public Generate API with health and reflection."""
from __future__ import annotations

import logging
import threading
import time

from common import grpc_util, security
from common.engine.models import resolve_model_path
from common.state import StateStore, StateUnavailable
from common.engine.tokenizer import load_tokenizer
from common.engine.weights import read_model_config, weights_id_of
from protos import handoff_pb2_grpc
from router.config import RouterConfig
from router.service import Router, RouterServicer

log = logging.getLogger(__name__)

SERVICE_NAMES = ["handoff.v1.Router"]


class RouterServer:
    def __init__(self, config: RouterConfig, state: StateStore):
        self.config = config
        self.state = state
        self.port = 0
        self.health_server = None
        self._ready = threading.Event()

    def start(self) -> "RouterServer":
        cfg = self.config
        credentials = security.server_credentials(cfg.tls, require_client_cert=cfg.tls.require_client_cert)
        keys = security.APIKeys(cfg.api_keys)
        if keys.enabled and credentials is None:
            log.warning("API keys are on but TLS is off: keys cross the network in plaintext")
        path = resolve_model_path(self.config.model)
        # The router needs the tokenizer and the model's shape, never the weights themselves.
        self.router = Router(self.config, self.state, load_tokenizer(path), read_model_config(path),
                             weights_id_of(path))
        self.server = grpc_util.make_server(
            cfg.server_threads, max_message_bytes=grpc_util.MAX_PUBLIC_MESSAGE_BYTES,
            interceptors=(security.APIKeyInterceptor(keys),) if keys.enabled else ())
        self.health = grpc_util.add_health_and_reflection(self.server, SERVICE_NAMES)
        handoff_pb2_grpc.add_RouterServicer_to_server(RouterServicer(self.router), self.server)
        self.port = grpc_util.bind(self.server, cfg.host, cfg.port, credentials)
        self.server.start()
        if cfg.health_port:
            self.health_server = grpc_util.serve_health(self.health, cfg.host, cfg.health_port)
        threading.Thread(target=self._become_ready, name="router-ready", daemon=True).start()
        tls = ("plaintext" if credentials is None else
               "TLS, client certificates required" if cfg.tls.require_client_cert else "TLS")
        log.info("router listening on %s:%d (%s; %s)", cfg.host, self.port, tls,
                 f"{len(keys)} API keys" if keys.enabled else "no API key needed")
        return self

    def _become_ready(self) -> None:
        # SERVING once Redis answers; workers may come later (requests then queue briefly).
        while not self._ready.is_set():
            try:
                self.state.ping()
                grpc_util.set_serving(self.health, SERVICE_NAMES, True)
                self._ready.set()
            except StateUnavailable as exc:
                log.warning("waiting for Redis: %s", exc)
                time.sleep(0.5)

    def stop(self, grace_s: float = 25.0) -> None:
        self._ready.set()
        grpc_util.set_serving(self.health, SERVICE_NAMES, False)
        self.server.stop(grace=grace_s).wait()
        if self.health_server is not None:
            self.health_server.stop(grace=None)
        self.router.close()
