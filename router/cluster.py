"""A whole handoff cluster in one process: embedded Redis, N prefill and M decode workers, the router.

    python -m router.cluster                       # serve Generate on :50051 until Ctrl-C
    python -m router.cluster --prompt "Hi there"   # answer one chat prompt through Generate, then exit

The workers share one copy of the weights (read-only) but each has its own engine and KV pool,
and they talk to each other over real gRPC on loopback, exactly as separate pods would.
"""
from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path

from common import cli, pki, redis_acl, security, settings, tracing
from common.engine.model import Llama
from common.engine.model_files import DEFAULT_MODEL, resolve_model_path
from common.redis_server import EmbeddedRedis, connect
from common.engine.hardware import auto_dtype
from common.engine.runner import DTYPE_NAMES, parse_dtype
from common.state import StateStore
from common.engine.tokenizer import load_tokenizer
from common.engine.weights import load_weights, trim_memory
from common.worker import WorkerConfig
from decode_svc.worker import DecodeWorker
from prefill_svc.worker import PrefillWorker
from router.config import RouterConfig
from router.server import RouterServer

log = logging.getLogger(__name__)


class Cluster:
    def __init__(self, *, model: str = DEFAULT_MODEL, num_prefill: int = 1, num_decode: int = 1,
                 port: int = 0, redis_url: str | None = None, dtype: str = settings.default("dtype"),
                 device: str = settings.default("device"), kv_memory_gib: float = settings.default("kv_memory_gib"),
                 threads: int = 0, router: RouterConfig | None = None,
                 worker: WorkerConfig | None = None, http_port: int = 0, tls_dir: str | None = None,
                 redis_acl: bool = False, redis_credentials: dict[str, tuple[str, str]] | None = None):
        mode = (router or RouterConfig()).prefill_mode
        if num_decode < 1 or num_prefill < (1 if mode == "disaggregated" else 0):
            raise ValueError("a cluster needs at least one decode worker, and one prefill worker unless "
                             "prompts may be prefilled on the decode workers (prefill_mode colocated or conditional)")
        self.model_name = model
        self.num_prefill, self.num_decode = num_prefill, num_decode
        self.redis_url = redis_url
        # The OpenAI-compatible HTTP API is on (http_port 0: a free port; -1: off).
        self.router_config = replace(router or RouterConfig(), host="127.0.0.1", port=port, model=model,
                                     redis_url=redis_url, http_port=http_port)
        # API keys come in with `router`. TLS with tls_dir (python -m common.pki's files: each service gets the
        # certificate of its role, the router's public port public.crt); several workers cannot share one
        # health port.
        self.worker_config = replace(worker or WorkerConfig(role="prefill"), host="127.0.0.1", port=0,
                                     advertise_host="127.0.0.1", model=model, dtype=dtype, device=device,
                                     kv_memory_gib=kv_memory_gib, kv_port=0, metrics_port=-1, health_port=0)
        self.tls_dir = tls_dir
        # Least privilege in Redis whenever TLS is on, as in a deployment: an ACL user per role.
        self.redis_acl = redis_acl or tls_dir is not None
        self.redis_credentials = dict(redis_credentials or {})
        if tls_dir is not None:
            self.router_config = replace(self.router_config, tls=security.role_tls(
                tls_dir, "router", require_client_cert=self.router_config.tls.require_client_cert))
        self.threads = threads
        self.redis: EmbeddedRedis | None = None
        self.prefill: list[PrefillWorker] = []
        self.decode: list[DecodeWorker] = []
        self.router: RouterServer | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.router.port}"

    @property
    def http_url(self) -> str:
        """The OpenAI-compatible API's base URL (an openai client's base_url), when HTTP is on."""
        return f"http://127.0.0.1:{self.router.http_port}/v1"

    def start(self) -> "Cluster":
        import torch

        # Several engines share the cores: one intra-op thread each avoids OpenMP teams spinning
        # against each other, which costs far more than it gains on a small machine.
        torch.set_num_threads(self.threads or max(1, (os.cpu_count() or 1) // (self.num_prefill + self.num_decode)))
        self.states = self._connect()
        self.state = self.states["router"]  # what the router uses; each worker has its role's
        path = resolve_model_path(self.model_name)
        weights = load_weights(path)
        model = Llama(weights.config, weights.tensors, dtype=parse_dtype(self.worker_config.dtype, self.worker_config.device),
                      device=self.worker_config.device,
                      packed=weights.packed, pack_layers=self.worker_config.packed_decode)
        model.weights_id = weights.weights_id
        del weights
        trim_memory()
        tokenizer = load_tokenizer(path)
        for i in range(self.num_prefill):
            cfg = replace(self.worker_config, role="prefill", worker_id=f"prefill-{i}", tls=self._tls("prefill"))
            self.prefill.append(PrefillWorker(cfg, self.states["prefill"], model=model, tokenizer=tokenizer).start())
        for i in range(self.num_decode):
            cfg = replace(self.worker_config, role="decode", worker_id=f"decode-{i}", tls=self._tls("decode"))
            self.decode.append(DecodeWorker(cfg, self.states["decode"], model=model, tokenizer=tokenizer).start())
        for w in self.prefill + self.decode:
            if not w.registration.registered.wait(10):
                raise RuntimeError(f"worker {w.config.worker_id} did not register in Redis within 10 s")
        self.router = RouterServer(replace(self.router_config, redis_url=self.redis_url), self.states["router"]).start()
        return self

    def _connect(self) -> dict[str, StateStore]:
        """A store per role (router, prefill, decode, operator). With redis_acl (implied by tls_dir) and no
        redis_url, the embedded Redis has an ACL user per role (common/redis_acl.py) and each service connects
        as its own; with a redis_url, redis_credentials (role -> (username, password)) does the same, else
        every service is the environment's REDIS_USERNAME / REDIS_PASSWORD."""
        if self.redis_url is None and self.redis_acl:
            self.redis = EmbeddedRedis(acl_users={role: secrets.token_urlsafe(24) for role in redis_acl.ROLES}).start()
            self.redis_url = f"redis://127.0.0.1:{self.redis.port}/0"
            self.redis_credentials = {role: self.redis.credentials(role) for role in redis_acl.ROLES}
            self.router_config = replace(self.router_config, redis_url=self.redis_url)
        if self.redis_credentials:
            return {role: StateStore(connect(self.redis_url, username=user, password=password)[0])
                    for role, (user, password) in self.redis_credentials.items()}
        client, self.redis = connect(self.redis_url, password=cli.redis_password(), username=cli.redis_username())
        return dict.fromkeys(redis_acl.ROLES, StateStore(client))

    def _tls(self, role: str):
        return self.worker_config.tls if self.tls_dir is None else security.role_tls(self.tls_dir, role)

    def stop(self, drain_timeout_s: float = 5.0) -> None:
        if self.router:
            self.router.stop(grace_s=drain_timeout_s)
        for w in self.prefill + self.decode:
            w.stop(drain_timeout_s)
        if self.redis:
            self.redis.stop()

    def check_integrity(self) -> None:
        """Every decode pool consistent; call when idle to also see all blocks free."""
        for w in self.decode + self.prefill:
            w.engine.check_integrity()

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def write_operator_env(cluster: Cluster) -> Path:
    """REDIS_USERNAME and REDIS_PASSWORD of the operator's ACL user, in a file only this user may read (never
    on the terminal or in a log), removed with the embedded Redis's folder."""
    user, password = cluster.redis_credentials["operator"]
    path = Path(cluster.redis.folder) / "operator.env"
    pki.write_private(path, f"REDIS_USERNAME={user}\nREDIS_PASSWORD={password}\n".encode())
    return path


# The one-shot answer's sampling when neither the command nor the model's files set any: a 135M model at
# temperature 1.0 often drifts into word salad after a sentence. SmolLM2's model card samples with these.
DEMO_SAMPLING = {"temperature": 0.2, "top_p": 0.9}
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p")


def demo_sampling(args: argparse.Namespace, file_defaults: dict) -> str:
    """Fill DEMO_SAMPLING into `args` where it applies; what the answer samples with, in words."""
    if any(getattr(args, name) is not None for name in _SAMPLING_FIELDS):
        return "as the command line sets it"
    if any(name in file_defaults for name in _SAMPLING_FIELDS):
        return "the model's own settings (" + ", ".join(f"{k} {v}" for k, v in file_defaults.items()) + ")"
    for name, value in DEMO_SAMPLING.items():
        setattr(args, name, value)
    return (", ".join(f"{k} {v}" for k, v in DEMO_SAMPLING.items()) + " (this command's demo default: the "
            "model's files set none; --temperature 1 --top-p 1 samples the model's raw distribution, "
            "--temperature 0 is greedy)")


def parse_args(argv=None) -> tuple[argparse.Namespace, RouterConfig, WorkerConfig]:
    """The command line (and HANDOFF_* environment) as the cluster's router and worker configs."""
    from router import client

    p = argparse.ArgumentParser(prog="python -m router.cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    settings.add_to(p, settings.CLUSTER)
    p.add_argument("--prefill", type=int, default=None,
                   help="prefill workers (default 1; 0 with --prefill-mode colocated)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    client.add_request_flags(p, prompt_help="a user turn of a chat, rendered by the model's chat template "
                                            "(python -m router.client --prompt sends raw text)")
    args = p.parse_args(argv)
    cli.setup_logging(args.log_level)
    if args.prefill is None:
        args.prefill = 0 if args.prefill_mode == "colocated" else 1
    try:
        return args, RouterConfig.from_settings(vars(args)), WorkerConfig.from_settings("prefill", vars(args))
    except ValueError as exc:
        p.error(str(exc))


def main(argv=None) -> None:
    from router import client

    args, router, worker = parse_args(argv)
    try:
        tracing.configure("handoff-cluster")
    except tracing.TracingConfigError as exc:
        raise SystemExit(f"router.cluster: {exc}") from None
    cluster = Cluster(model=args.model, num_prefill=args.prefill, num_decode=args.decode, port=args.port,
                      redis_url=args.redis_url, dtype=args.dtype, device=args.device,
                      kv_memory_gib=args.kv_memory_gib, threads=args.threads, router=router, worker=worker,
                      http_port=args.http_port, redis_acl=args.redis_acl)
    dtype = DTYPE_NAMES[parse_dtype(args.dtype)]
    why = f", {auto_dtype()[1]}" if args.dtype == "auto" else ""
    print(f"starting: {args.prefill} prefill + {args.decode} decode workers ({args.prefill_mode}), "
          f"model {args.model} ({dtype}{why})",
          file=sys.stderr)
    cluster.start()
    print(f"handoff cluster serving Generate on {cluster.address}"
          + (f", the OpenAI API at {cluster.http_url}" if args.http_port >= 0 else ""), file=sys.stderr)
    if cluster.redis is not None and cluster.redis_credentials:
        path = write_operator_env(cluster)
        print(f"Redis ACLs on (a user per role); the operator's credentials: set -a; . {path}; set +a; "
              f"python -m router.status --redis-url {cluster.redis_url}", file=sys.stderr)
    try:
        if args.prompt or args.message:
            if args.prompt and not args.message:
                # A prompt from the command line is a user turn of a chat, rendered by the model's template.
                args.message, args.prompt = [f"user:{args.prompt}"], None
            print(f"sampling: {demo_sampling(args, cluster.router.sampling_defaults)}", file=sys.stderr)
            print_summary = client.print_summary
            print_summary(client.stream(cluster.address, client.build_request(args), args.timeout_s))
        else:
            stop = threading.Event()
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
            print("Ctrl-C to stop; try: python -m router.client --target "
                  f"{cluster.address} --message 'user:Hello'", file=sys.stderr)
            stop.wait()
    finally:
        cluster.stop()
        tracing.close()


if __name__ == "__main__":
    main()
