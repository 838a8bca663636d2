"""What prefill and decode workers share: their config, registration in Redis, drain on SIGTERM."""
from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import threading
import time
import uuid
from dataclasses import dataclass, fields, replace
from typing import Callable

import grpc
import torch

from common import authz, cli, grpc_common, metrics, security, settings, tracing
from common.engine.engine import Engine
from common.grpc_common import ServiceError
from common.engine.kv_cache import KVCache
from common.kv_wire import ModelFingerprint
from common.engine.model import Llama
from common.engine.model_files import resolve_model_path
from common.redis_server import announce_embedded, connect
from common.engine.runner import ModelRunner, parse_dtype
from common.security import TLSConfig
from common.settings import default
from common.state import StatePermissionDenied, StateStore, StateUnavailable, WorkerInfo
from common.engine.tokenizer import load_tokenizer
from common.engine.weights import load_weights, trim_memory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    """Defaults from common/settings.py (the flags' table), except a library user's free ports (0)."""
    role: str
    host: str = default("host")
    port: int = 0
    advertise_host: str | None = None
    worker_id: str | None = None
    redis_url: str | None = None
    model: str = default("model")
    dtype: str = default("dtype")
    device: str = default("device")
    threads: int = default("threads")
    metrics_port: int = 0
    health_port: int = default("health_port")  # plaintext grpc.health.v1 only, for probes when TLS is on
    tls: TLSConfig = TLSConfig()  # off by default; on, every port of the worker requires client certificates
    drain_timeout_s: float = default("drain_timeout_s")
    heartbeat_s: float = 0.5  # a dead worker leaves the registry within heartbeat_ttl_s
    heartbeat_ttl_s: float = 2.0
    block_size: int = 16
    max_prefill_tokens: int = default("max_prefill_tokens")
    prefill_chunk_tokens: int = default("prefill_chunk_tokens")  # prompts are prefilled in chunks (prefix.py)
    prefix_caching: bool = default("prefix_caching")
    max_running: int = default("max_running")
    packed_decode: bool = default("packed_decode")  # decode reads the GGUF's packed matrices (model.py)
    dense_weights: str = default("dense_weights")  # dense copies of the packed matrices for prefill (model.py)
    # decode only
    kv_port: int = default("kv_port")
    kv_memory_gib: float = default("kv_memory_gib")
    kv_wait_s: float = default("kv_wait_s")
    # prefill only: its own small pool holds prompts only while they are computed
    prefill_kv_tokens: int = default("prefill_kv_tokens")
    stream_kv: bool = default("stream_kv")

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {self.role!r}")
        for name in ("block_size", "max_prefill_tokens", "max_running", "prefill_kv_tokens", "prefill_chunk_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_memory_gib <= 0:
            raise ValueError(f"kv_memory_gib must be positive, got {self.kv_memory_gib}")
        if self.dense_weights not in settings.DENSE_WEIGHTS:
            raise ValueError(f"dense_weights must be auto, keep or lazy, got {self.dense_weights!r}")
        if not 0 < self.heartbeat_s < self.heartbeat_ttl_s:
            raise ValueError("heartbeat_s must be positive and shorter than heartbeat_ttl_s")
        self.tls.check_for_service()

    @classmethod
    def from_args(cls, role: str, argv: list[str] | None) -> "WorkerConfig":
        p = argparse.ArgumentParser(prog=f"python -m {role}_svc", description=f"handoff {role} worker")
        settings.add_to(p, role)
        args = vars(p.parse_args(argv))
        cli.setup_logging(args.pop("log_level"))
        try:
            config = cls.from_settings(role, args)
            # A bad certificate, or another role's, stops the worker now, not after loading the model.
            security.check(config.tls, role)
            return config
        except ValueError as exc:
            p.error(str(exc))

    @classmethod
    def from_settings(cls, role: str, args: dict) -> "WorkerConfig":
        """A worker's fields of parsed settings (router.cluster's carry the router's too)."""
        names = {f.name for f in fields(cls)} - {"role", "tls"}
        return cls(role=role, tls=cli.tls_config(args), **{k: v for k, v in args.items() if k in names})

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
    """Keeps this worker's registry entry alive; a Redis restart is healed by the next beat.

    No error ends the heartbeat: an unreachable Redis, one that refuses commands (OOM, READONLY,
    NOPERM) or a bug in a hook is logged and retried on the next beat. `on_status(True/False)`
    says when the entry starts and stops being current (no beat for ttl_s: routers no longer
    see this worker), so health can say NOT_SERVING while nobody can route here.
    """

    def __init__(self, state: StateStore, info: Callable[[], WorkerInfo], *, interval_s: float, ttl_s: float,
                 on_status: Callable[[bool], None] = lambda registered: None,
                 on_beat: Callable[[], None] = lambda: None):
        self.state = state
        self._info = info
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self._on_status = on_status
        self._on_beat = on_beat  # after every heartbeat that reached Redis
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self.registered = threading.Event()  # set by the first successful beat, never cleared
        self.current = False  # the entry is live in Redis (a beat succeeded within ttl_s)

    def start(self) -> "Registration":
        self._thread.start()
        return self

    def _run(self) -> None:
        last_ok = None
        failing_since = None
        while not self._stop.is_set():
            try:
                self.state.heartbeat(self._info(), self.ttl_s)
                last_ok = time.monotonic()
                if failing_since is not None:
                    log.warning("heartbeat works again after %.1f s; re-registered", last_ok - failing_since)
                    failing_since = None
                self.registered.set()
                self._set_current(True)
            except Exception as exc:  # noqa: BLE001 - the heartbeat must outlive any error
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.warning("heartbeat failed, will keep trying: %s", exc,
                                exc_info=not isinstance(exc, StateUnavailable))
                if last_ok is None or time.monotonic() - last_ok >= self.ttl_s:
                    self._set_current(False)
            else:
                try:
                    self._on_beat()
                except Exception as exc:  # noqa: BLE001
                    log.warning("after the heartbeat: %s", exc, exc_info=not isinstance(exc, StateUnavailable))
            self._stop.wait(self.interval_s)

    def _set_current(self, current: bool) -> None:
        if current != self.current:
            self.current = current
            if not current:
                log.warning("registration lapsed: routers no longer see this worker until Redis answers")
            self._on_status(current)

    def stop(self, deregister: bool = True, keep_leases: bool = False) -> None:
        """End the heartbeat (also before start(): it then never beats) and leave the registry, with the
        leases on this worker unless keep_leases (a drain: its requests keep theirs until they end)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if deregister:
            info = self._info()
            try:
                self.state.deregister(info.worker_id, info.epoch, info.role, keep_leases=keep_leases)
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
        self.engine_failed = threading.Event()  # the engine thread died: this worker serves nothing more
        self._health_lock = threading.Lock()
        self.drain_requested = threading.Event()  # an operator ran `python -m router.status drain`
        # What a drain request does: stop in the background here; serve() makes it do what SIGTERM does.
        self.on_drain_request: Callable[[], None] = self._stop_in_background
        self._inflight_ids: set[tuple[str, str]] = set()  # (rpc, request_id) of calls in progress
        self._inflight_lock = threading.Lock()
        self.started_at = time.time()
        self.metrics_port = 0  # set by serve() once /metrics listens
        self._published: tuple[list[bytes], float] = ([], 0.0)  # prefix hashes last published, and when
        self._reaps = True  # ends dead routers' requests after each beat, while Redis lets it
        self.server = None
        self.health = None
        self.health_server = None
        self.engine = None
        self.registration: Registration | None = None
        # Called (on the engine thread) once the engine has failed and this worker is out of service:
        # serve() makes it end the process, so that its supervisor starts a fresh one.
        self.on_engine_failure: Callable[[], None] = lambda: None
        # This worker's certificate, key and CA, re-read when they change: served on its ports, presented
        # on every outgoing internal channel.
        self.tls_files = security.tls_files(config.tls)

    # ---- model

    def _load_model(self):
        if self._model is None:
            weights = load_weights(self.config.model)
            # Each pool holds what its phase reads: a prefill worker the dense matrices its GEMMs take and no
            # packed ones; a decode worker the packed matrices it streams, and the dense ones only if it keeps
            # them for prefills of its own (colocated, conditional).
            decodes = self.config.role == "decode"
            keep = self.config.dense_weights == "keep" or (self.config.dense_weights == "auto" and not decodes)
            self._model = Llama(weights.config, weights.tensors, dtype=parse_dtype(self.config.dtype, self.config.device),
                                device=self.config.device, packed=weights.packed,
                                pack_layers=decodes and self.config.packed_decode, keep_dense=keep)
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
        # Internal ports are mutual TLS whenever TLS is on: only holders of a certificate from the CA call them,
        # and each method only callers of the roles authz.ALLOWED_ROLES names.
        self.server_credentials = (self.tls_files.server_credentials(require_client_cert=True)
                                   if self.tls_files else None)
        set_threads(self.config.threads)
        self.model = self._load_model()
        cache = KVCache(self.model.config, self._num_blocks(), self.config.block_size, self.model.dtype,
                        self.model.device)
        runner = ModelRunner(self.model, cache, self.config.packed_decode)
        # Readiness (the overall and per-service health) follows the registration: SERVING only while
        # routers can see this worker. Liveness ("liveness") stays SERVING while the process runs and its
        # engine lives, so a Redis outage never gets a busy pod restarted. Made (not started) before the
        # engine, whose failure stops it whenever that comes (_engine_failure).
        self.registration = Registration(
            self.state, self.info, interval_s=self.config.heartbeat_s, ttl_s=self.config.heartbeat_ttl_s,
            on_status=self._registration_status, on_beat=self._after_beat)
        self.engine = Engine(runner, self.tokenizer, self._engine_config())
        self.engine.failure_listeners.append(self._engine_failure)
        self.engine.start()
        self.server = grpc_common.make_server(self.max_rpcs(), max_message_bytes=grpc_common.MAX_INTERNAL_MESSAGE_BYTES,
                                              interceptors=self.interceptors())
        self.health = grpc_common.add_health_and_reflection(self.server, self.service_names)
        if self.engine_failed.is_set():
            grpc_common.set_dead(self.health, self.service_names)
        self._add_services(self.server)
        port = grpc_common.bind(self.server, self.config.host, self.config.port, self.server_credentials,
                              flag="--port")
        self.config = self.config.resolved(port)
        self._start_extra()
        self.server.start()
        if self.config.health_port:
            self.health_server = grpc_common.serve_health(self.health, self.config.host, self.config.health_port)
        self.registration.start()
        log.info("%s worker %s listening on %s:%d (epoch %s, %s)", self.config.role, self.config.worker_id,
                 self.config.host, self.config.port, self.epoch,
                 "mutual TLS" if self.server_credentials else "plaintext")
        return self

    def _add_services(self, server) -> None:
        raise NotImplementedError

    def _engine_failure(self, exc: BaseException) -> None:
        """The engine thread died (it logged why) and is about to end every request it held with the error.
        This worker can serve nothing more: out of service at once, so that routers send it nothing new
        and fail its requests over elsewhere, charged to it. Health says NOT_SERVING on every service,
        liveness included (only a new process brings an engine back, so Kubernetes restarts the pod), new
        calls are refused, and it leaves the registry (with its leases) on a thread of its own, so the
        engine does not wait on Redis to end its requests; if Redis cannot be reached, the entry lapses
        within heartbeat_ttl_s, as no heartbeat renews it any more (invariant 6 (a stated worst-case bound):
        a cut-off worker stops getting work)."""
        with self._health_lock:
            self.engine_failed.set()
            if self.health is not None:
                grpc_common.set_dead(self.health, self.service_names)
        log.error("%s worker %s: its engine failed (%s: %s); out of service: NOT_SERVING, leaving the registry",
                  self.config.role, self.config.worker_id, type(exc).__name__, exc)
        threading.Thread(target=self._leave_registry, name="engine-failed", daemon=True).start()
        self.on_engine_failure()

    def _registration_status(self, current: bool) -> None:
        """The heartbeat's say on readiness: SERVING while routers see this worker, unless it drains or its
        engine failed (the lock keeps a beat that lands as the engine fails from saying SERVING after it)."""
        with self._health_lock:
            grpc_common.set_serving(self.health, self.service_names,
                                    current and not self.draining.is_set() and not self.engine_failed.is_set())

    def _leave_registry(self) -> None:
        try:
            self.registration.stop(deregister=True)
        except Exception:  # noqa: BLE001 - the entry still lapses by itself within heartbeat_ttl_s
            log.exception("could not leave the registry after the engine failed")

    def interceptors(self) -> tuple[grpc.ServerInterceptor, ...]:
        """Before the error interceptor on every port of this worker: with TLS, authorization by role."""
        if self.tls_files is None:
            return ()
        return (authz.AuthorizationInterceptor(self.tls_files.identity),)

    def max_rpcs(self) -> int:
        """Calls the main server runs at once; beyond, gRPC answers RESOURCE_EXHAUSTED."""
        return 256

    def _start_extra(self) -> None:
        """Extra servers (decode's KV port); after the main port is bound."""

    def _stop_extra(self) -> None:
        """Stops what _start_extra started."""

    @property
    def identity(self) -> str:
        """The SPIFFE ID of this worker's certificate, registered with it; "" with TLS off."""
        identity = self.tls_files.identity if self.tls_files else None
        return identity.spiffe_id if identity else ""

    def prefix_info(self) -> dict:
        """WorkerInfo fields saying how this worker names prompt prefixes (for cache-aware routing)."""
        hasher = self.engine.hasher
        return dict(prefix_seed=hasher.seed.hex(), chunk_tokens=hasher.chunk_tokens)

    def _publish_prefixes(self) -> None:
        """Publish the prefixes the KV cache holds when they change, and at least every 5 s (the set
        expires after 20 s, so a dead worker's goes with it)."""
        hashes = self.engine.cached_chunk_hashes()
        now = time.monotonic()
        if hashes == self._published[0] and now - self._published[1] < 5.0:
            return
        self.state.publish_prefixes(self.config.worker_id, hashes, ttl_s=20.0, role=self.config.role)
        self._published = (hashes, now)

    def _after_beat(self) -> None:
        self._check_drain_request()
        self._publish_prefixes()
        # Any survivor ends the requests of a router that died (its registration lapsed), unless Redis ACLs
        # make request records the routers' alone (common/redis_acl.py): then a router, restarted or not, does.
        if self._reaps:
            try:
                reaped = self.state.reap_routers()
            except StatePermissionDenied:
                log.info("dead routers' requests are the routers' to end: this worker's Redis user may not")
                self._reaps = False
                return
            for router_id, num_ended in reaped.items():
                log.warning("router %s is gone: ended its %d requests still in flight", router_id, num_ended)

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
        if self.engine_failed.is_set():
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"{self.config.role} worker {self.config.worker_id} is out of service: its engine "
                               f"failed ({self.engine.failure!r}); retry on another worker")
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
        grpc_common.set_serving(self.health, self.service_names, False)
        # Leave the registry first so routers stop sending new requests here, keeping the leases of the
        # requests in flight: their routers go on renewing them, so a stream longer than the lease TTL
        # finishes here instead of being declared lost and failed over (invariant 6: the drain's bound is
        # drain_timeout_s, not the lease TTL).
        self.registration.stop(deregister=True, keep_leases=True)
        deadline = time.monotonic() + timeout
        while (self.num_inflight > 0 or self.engine.num_active > 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.num_inflight or self.engine.num_active:
            log.warning("drain timeout: %d RPCs, %d sequences still running; cancelling them",
                        self.num_inflight, self.engine.num_active)
        self.engine.stop()
        self.server.stop(grace=1.0).wait()
        self._stop_extra()
        if self.config.role == "decode":  # only decode workers hold leases (and may write them: redis_acl)
            try:
                self.state.drop_leases(self.config.worker_id, self.epoch)  # those the drain timeout cut short
            except StateUnavailable as exc:
                log.warning("could not drop the leases left on this worker (they expire by themselves): %s", exc)
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
            self.state.mark_drained(self.config.role, self.config.worker_id, self.epoch, ttl_s=300.0)
        except StateUnavailable as exc:
            log.warning("could not clear the drain request (it expires by itself): %s", exc)


def serve(worker_cls: type[WorkerBase], config: WorkerConfig) -> None:
    """`python -m prefill_svc` / `decode_svc`: serve until SIGTERM/SIGINT, then drain (Kubernetes
    gives terminationGracePeriodSeconds)."""
    try:
        tracing.configure(f"handoff-{config.role}")
    except tracing.TracingConfigError as exc:
        raise SystemExit(f"{config.role} worker: {exc}") from None
    client, embedded = connect(config.redis_url, password=cli.redis_password(), username=cli.redis_username())
    if embedded:
        announce_embedded(embedded, f"{config.role} worker")
    metrics_port = metrics.serve_metrics(config.metrics_port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    security.reload_on_sighup()  # certificates are also re-read when they change, within a second
    worker = worker_cls(config, StateStore(client))
    worker.metrics_port = metrics_port
    worker.on_drain_request = stop.set  # `python -m router.status drain` does what SIGTERM does
    worker.on_engine_failure = stop.set  # nothing left to serve: exit, and let the supervisor start anew
    try:
        try:
            worker.start()
        except grpc_common.PortInUse as exc:
            raise SystemExit(f"{config.role} worker: {exc}") from None  # one line, no traceback
        stop.wait()
        if worker.engine_failed.is_set():
            worker.stop(drain_timeout_s=1.0)  # the engine has ended every request already
            raise SystemExit(f"{config.role} worker {worker.config.worker_id}: the engine failed "
                             f"({worker.engine.failure!r}); exiting")
        log.info("%s: draining", "drain requested" if worker.drain_requested.is_set() else "signal received")
        worker.stop()
    finally:
        tracing.close()
        if embedded:
            embedded.stop()
