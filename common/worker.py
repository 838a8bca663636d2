"""What prefill and decode workers share: their config, registration in Redis, drain on SIGTERM."""
from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import Callable

import grpc
import torch

from common import cli, grpc_util, metrics, security
from common.engine.engine import Engine
from common.grpc_util import ServiceError
from common.engine.kv_cache import KVCache
from common.kv_wire import ModelFingerprint
from common.engine.model import Llama
from common.engine.models import resolve_model_path
from common.redis_server import connect
from common.engine.runner import ModelRunner, parse_dtype
from common.security import TLSConfig
from common.state import StateStore, StateUnavailable, WorkerInfo
from common.engine.tokenizer import load_tokenizer
from common.engine.weights import load_weights, trim_memory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    role: str
    host: str = "0.0.0.0"
    port: int = 0
    advertise_host: str | None = None
    worker_id: str | None = None
    redis_url: str | None = None
    model: str = "smollm2"
    dtype: str = "bf16"
    device: str = "cpu"
    threads: int = 0
    metrics_port: int = 0
    health_port: int = 0  # plaintext grpc.health.v1 only, for probes when TLS is on; 0 = off
    tls: TLSConfig = TLSConfig()  # off by default; on, every port of the worker requires client certificates
    drain_timeout_s: float = 25.0
    heartbeat_s: float = 0.5  # a dead worker leaves the registry within heartbeat_ttl_s
    heartbeat_ttl_s: float = 2.0
    block_size: int = 16
    max_prefill_tokens: int = 2048
    max_running: int = 64
    int4_decode: bool = True  # packed 4-bit decode when the weights are GGUF Q4 (see runner.py)
    # decode only
    kv_port: int = 0
    kv_memory_gib: float = 1.0
    kv_wait_s: float = 30.0  # how long KV that arrived may wait for its Decode call, and vice versa
    # prefill only: its own small pool holds prompts only while they are computed
    prefill_kv_tokens: int = 16384

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {self.role!r}")
        for name in ("block_size", "max_prefill_tokens", "max_running", "prefill_kv_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_memory_gib <= 0:
            raise ValueError(f"kv_memory_gib must be positive, got {self.kv_memory_gib}")
        if not 0 < self.heartbeat_s < self.heartbeat_ttl_s:
            raise ValueError("heartbeat_s must be positive and shorter than heartbeat_ttl_s")
        self.tls.check_for_service()

    @classmethod
    def from_args(cls, role: str, argv: list[str] | None, *, port: int, metrics_port: int,
                  extra: Callable[[argparse.ArgumentParser], None] | None = None) -> "WorkerConfig":
        p = argparse.ArgumentParser(prog=f"python -m {role}_svc",
                                    description=f"handoff {role} worker")
        cli.add_common_flags(p, port=port, metrics_port=metrics_port)
        cli.add_worker_flags(p)
        if extra:
            extra(p)
        args = vars(p.parse_args(argv))
        log_level = args.pop("log_level")
        logging.basicConfig(level=log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        try:
            config = cls(role=role, tls=cli.pop_tls_config(args), **args)
            security.check(config.tls)  # a bad certificate stops the worker now, not after loading the model
            return config
        except ValueError as exc:
            p.error(str(exc))

    def resolved(self, bound_port: int) -> "WorkerConfig":
        host = self.advertise_host or cli.default_host()
        return replace(self, port=bound_port, advertise_host=host,
                       worker_id=self.worker_id or f"{self.role}-{host}-{bound_port}")


def new_epoch() -> str:
    """Changes at every process start, so pushes addressed to an earlier life are refused."""
    return uuid.uuid4().hex[:16]


def set_threads(threads: int) -> None:
    if threads > 0:
        torch.set_num_threads(threads)


class Registration:
    """Keeps this worker's registry entry alive; a Redis restart is healed by the next beat."""

    def __init__(self, state: StateStore, info: Callable[[], WorkerInfo], *, interval_s: float, ttl_s: float,
                 on_registered: Callable[[], None] = lambda: None, on_beat: Callable[[], None] = lambda: None):
        self.state = state
        self._info = info
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self._on_registered = on_registered
        self._on_beat = on_beat  # after every heartbeat that reached Redis; may raise StateUnavailable
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self.registered = threading.Event()

    def start(self) -> "Registration":
        self._thread.start()
        return self

    def _run(self) -> None:
        outage_since = None
        while not self._stop.is_set():
            try:
                self.state.heartbeat(self._info(), self.ttl_s)
                if outage_since is not None:
                    log.warning("Redis reachable again after %.1f s; re-registered", time.monotonic() - outage_since)
                    outage_since = None
                if not self.registered.is_set():
                    self.registered.set()
                    self._on_registered()
                self._on_beat()
            except StateUnavailable as exc:
                if outage_since is None:
                    outage_since = time.monotonic()
                    log.warning("heartbeat failed, will keep trying: %s", exc)
            self._stop.wait(self.interval_s)

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if deregister:
            info = self._info()
            try:
                self.state.deregister(info.worker_id, info.epoch)
            except StateUnavailable as exc:
                log.warning("could not deregister (the entry expires by itself): %s", exc)


class WorkerBase:
    """Model, engine, gRPC server, registry entry and graceful drain of one worker.

    Subclasses add their servicers in `_add_services` and say what they publish in `info()`.
    """

    service_names: list[str] = []

    def __init__(self, config: WorkerConfig, state: StateStore, *, model=None, tokenizer=None):
        self.config = config
        self.state = state
        self.epoch = new_epoch()
        self._model = model
        self.tokenizer = tokenizer
        self.draining = threading.Event()
        self.drain_requested = threading.Event()  # an operator ran `python -m router.status drain`
        # What a drain request does: stop in the background here; serve() makes it do what SIGTERM does.
        self.on_drain_request: Callable[[], None] = self._stop_in_background
        self._inflight_ids: set[tuple[str, str]] = set()  # (rpc, request_id) of calls in progress
        self._inflight_lock = threading.Lock()
        self.started_at = time.time()
        self.server = None
        self.health_server = None
        self.engine = None
        # Built once: every outgoing internal channel presents this worker's certificate.
        self.channel_credentials = security.channel_credentials(config.tls)

    # ---- model

    def _load_model(self):
        if self._model is None:
            weights = load_weights(self.config.model)
            self._model = Llama(weights.config, weights.tensors, dtype=parse_dtype(self.config.dtype),
                                device=self.config.device,
                                int4=weights.int4 if self.config.int4_decode else None)
            self._model.weights_id = weights.weights_id
            del weights
            trim_memory()
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(resolve_model_path(self.config.model))
        return self._model

    def _num_blocks(self) -> int:
        raise NotImplementedError

    def _engine_config(self):
        raise NotImplementedError

    def fingerprint(self) -> ModelFingerprint:
        return ModelFingerprint.for_model(self.model.config, weights_id=self.model.weights_id,
                                          block_size=self.config.block_size, dtype=self.model.dtype)

    # ---- lifecycle

    def start(self) -> "WorkerBase":
        # Internal ports are mutual TLS whenever TLS is on: only holders of a certificate from the CA call them.
        self.server_credentials = security.server_credentials(self.config.tls, require_client_cert=True)
        set_threads(self.config.threads)
        self.model = self._load_model()
        cache = KVCache(self.model.config, self._num_blocks(), self.config.block_size, self.model.dtype,
                        self.model.device)
        runner = ModelRunner(self.model, cache, self.config.int4_decode)
        self.engine = Engine(runner, self.tokenizer, self._engine_config()).start()
        self.server = grpc_util.make_server(max_workers=256,
                                            max_message_bytes=grpc_util.MAX_INTERNAL_MESSAGE_BYTES)
        self.health = grpc_util.add_health_and_reflection(self.server, self.service_names)
        self._add_services(self.server)
        port = grpc_util.bind(self.server, self.config.host, self.config.port, self.server_credentials)
        self.config = self.config.resolved(port)
        self._bind_extra(self.server)
        self.server.start()
        if self.config.health_port:
            self.health_server = grpc_util.serve_health(self.health, self.config.host, self.config.health_port)
        self.registration = Registration(
            self.state, self.info, interval_s=self.config.heartbeat_s, ttl_s=self.config.heartbeat_ttl_s,
            on_registered=lambda: grpc_util.set_serving(self.health, self.service_names, True),
            on_beat=self._check_drain_request).start()
        log.info("%s worker %s listening on %s:%d (epoch %s, %s)", self.config.role, self.config.worker_id,
                 self.config.host, self.config.port, self.epoch,
                 "mutual TLS" if self.server_credentials else "plaintext")
        return self

    def _add_services(self, server) -> None:
        raise NotImplementedError

    def _bind_extra(self, server) -> None:
        """Extra ports (decode's KV port, with self.server_credentials); called after the main port is bound."""

    @property
    def address(self) -> str:
        return f"{self.config.advertise_host}:{self.config.port}"

    def info(self) -> WorkerInfo:
        raise NotImplementedError

    @contextlib.contextmanager
    def serving(self, rpc: str, request_id: str):
        """Wraps an RPC that takes new work: refused while draining, refused for a request id that
        already has this RPC running here, and counted in flight so a drain waits for it."""
        if self.draining.is_set():
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"{self.config.role} worker {self.config.worker_id} is shutting down; "
                               f"retry on another worker")
        key = (rpc, request_id)
        with self._inflight_lock:
            # A second call for the same id would fail in the engine, and its end would cancel the
            # first call's sequence. ABORTED, which the router retries: the first may be a
            # cancelled attempt still winding down.
            if key in self._inflight_ids:
                raise ServiceError(grpc.StatusCode.ABORTED,
                                   f"a {rpc} for request {request_id!r} is already running on this worker")
            self._inflight_ids.add(key)
        try:
            yield
        finally:
            with self._inflight_lock:
                self._inflight_ids.discard(key)

    @property
    def num_inflight(self) -> int:
        return len(self._inflight_ids)

    def stop(self, drain_timeout_s: float | None = None) -> None:
        """Stop taking work, let what is in flight finish (up to the drain timeout), deregister, exit."""
        timeout = self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        self.draining.set()
        if self.server is None:
            return
        grpc_util.set_serving(self.health, self.service_names, False)
        # Leave the registry first so routers stop sending new requests here.
        self.registration.stop(deregister=True)
        deadline = time.monotonic() + timeout
        while (self.num_inflight > 0 or self.engine.num_active > 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.num_inflight or self.engine.num_active:
            log.warning("drain timeout: %d RPCs, %d sequences still running; cancelling them",
                        self.num_inflight, self.engine.num_active)
        self.engine.stop()
        self.server.stop(grace=1.0).wait()
        if self.health_server is not None:
            self.health_server.stop(grace=None)
        self._end_drain_request()
        log.info("%s worker %s stopped", self.config.role, self.config.worker_id)

    # ---- drain on request (python -m router.status drain WORKER_ID)

    def _check_drain_request(self) -> None:
        """On the heartbeat thread, after each beat: a drain request for this epoch starts the drain once."""
        if self.drain_requested.is_set() or self.draining.is_set():
            return
        if self.state.drain_requested(self.config.worker_id, self.epoch):
            log.warning("%s worker %s: drain requested by an operator; draining", self.config.role,
                        self.config.worker_id)
            self.drain_requested.set()
            self.on_drain_request()

    def _stop_in_background(self) -> None:
        # stop() joins the heartbeat thread, which is the caller here.
        threading.Thread(target=self.stop, name="drain", daemon=True).start()

    def _end_drain_request(self) -> None:
        """Tells the waiting `router.status drain` that this worker has finished its work."""
        if not self.drain_requested.is_set():
            return
        try:
            self.state.end_drain(self.config.worker_id, self.epoch)
        except StateUnavailable as exc:
            log.warning("could not clear the drain request (it expires by itself): %s", exc)


def serve(worker_cls: type[WorkerBase], config: WorkerConfig) -> None:
    """`python -m prefill_svc` / `decode_svc`: serve until SIGTERM/SIGINT, then drain (Kubernetes
    gives terminationGracePeriodSeconds)."""
    client, embedded = connect(config.redis_url, password=cli.redis_password(), username=cli.redis_username())
    metrics.serve_metrics(config.metrics_port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    worker = worker_cls(config, StateStore(client))
    worker.on_drain_request = stop.set  # `python -m router.status drain` does what SIGTERM does
    try:
        worker.start()
        stop.wait()
        log.info("%s: draining", "drain requested" if worker.drain_requested.is_set() else "signal received")
        worker.stop()
    finally:
        if embedded:
            embedded.stop()
