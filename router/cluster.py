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
import signal
import sys
import threading
from dataclasses import replace

from common import cli
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
from router.config import PREFILL_MODES, RouterConfig
from router.server import RouterServer

log = logging.getLogger(__name__)


class Cluster:
    def __init__(self, *, model: str = DEFAULT_MODEL, num_prefill: int = 1, num_decode: int = 1,
                 port: int = 0, redis_url: str | None = None, dtype: str = "auto", device: str = "cpu",
                 kv_memory_gib: float = 0.5, threads: int = 0, router: RouterConfig | None = None,
                 worker: WorkerConfig | None = None, http_port: int = 0):
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
        # TLS and API keys come in with `router` and `worker`; workers share one TLS config (and
        # its certificate), and several workers cannot share one health port.
        self.worker_config = replace(worker or WorkerConfig(role="prefill"), host="127.0.0.1", port=0,
                                     advertise_host="127.0.0.1", model=model, dtype=dtype, device=device,
                                     kv_memory_gib=kv_memory_gib, kv_port=0, metrics_port=-1, health_port=0)
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
        client, self.redis = connect(self.redis_url, password=cli.redis_password(), username=cli.redis_username())
        self.state = StateStore(client)
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
            cfg = replace(self.worker_config, role="prefill", worker_id=f"prefill-{i}")
            self.prefill.append(PrefillWorker(cfg, self.state, model=model, tokenizer=tokenizer).start())
        for i in range(self.num_decode):
            cfg = replace(self.worker_config, role="decode", worker_id=f"decode-{i}")
            self.decode.append(DecodeWorker(cfg, self.state, model=model, tokenizer=tokenizer).start())
        for w in self.prefill + self.decode:
            if not w.registration.registered.wait(10):
                raise RuntimeError(f"worker {w.config.worker_id} did not register in Redis within 10 s")
        self.router = RouterServer(replace(self.router_config, redis_url=self.redis_url), self.state).start()
        return self

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


def main(argv=None) -> None:
    from router import client

    p = argparse.ArgumentParser(prog="python -m router.cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=cli.env("HANDOFF_MODEL", DEFAULT_MODEL))
    p.add_argument("--served-model-name", default=cli.env("HANDOFF_SERVED_MODEL_NAME", ""),
                   help="the model name(s) the OpenAI API answers to, comma-separated (responses report the "
                        "first); empty = the model's own name (smollm2, a .gguf file's stem, an HF folder's name)")
    p.add_argument("--prefill-mode", choices=PREFILL_MODES, default=cli.env("HANDOFF_PREFILL_MODE", "disaggregated"),
                   help="where prompts are prefilled: on prefill workers (disaggregated), on the decode workers "
                        "(colocated) or by prompt length (conditional, see --remote-prefill-min-tokens)")
    p.add_argument("--remote-prefill-min-tokens", type=int, default=RouterConfig.remote_prefill_min_tokens,
                   help="conditional: the shortest prompt prefilled on a prefill worker")
    p.add_argument("--remote-prefill-max-queue-ratio", type=float,
                   default=RouterConfig.remote_prefill_max_queue_ratio,
                   help="conditional: prefill on the decode worker a prompt that would queue behind more than "
                        "this many times its length in prompts no longer than it on the prefill worker (0 = off)")
    p.add_argument("--prefill", type=int, default=None, help="prefill workers (default 1; 0 when colocated)")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--port", type=int, default=50051, help="the router's Generate port")
    p.add_argument("--http-port", type=int, default=8000,
                   help="the router's OpenAI-compatible HTTP API; 0 = a free port, -1 = off")
    p.add_argument("--redis-url", default=cli.env("REDIS_URL"), help="unset = an embedded Redis server")
    p.add_argument("--dtype", default=cli.env("HANDOFF_DTYPE", "auto"),
                   help="auto (bf16 where the hardware multiplies it natively, else fp32), fp32, bf16")
    p.add_argument("--kv-memory-gib", type=float, default=0.5, help="KV pool per decode worker")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = cores / workers")
    client.add_request_flags(p)
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.prefill is None:
        args.prefill = 0 if args.prefill_mode == "colocated" else 1
    try:
        router = RouterConfig(prefill_mode=args.prefill_mode, remote_prefill_min_tokens=args.remote_prefill_min_tokens,
                              remote_prefill_max_queue_ratio=args.remote_prefill_max_queue_ratio,
                              served_model_name=args.served_model_name)
    except ValueError as exc:
        p.error(str(exc))
    cluster = Cluster(model=args.model, num_prefill=args.prefill, num_decode=args.decode, port=args.port,
                      redis_url=args.redis_url, dtype=args.dtype, kv_memory_gib=args.kv_memory_gib,
                      threads=args.threads, router=router, http_port=args.http_port)
    dtype = DTYPE_NAMES[parse_dtype(args.dtype)]
    why = f", {auto_dtype()[1]}" if args.dtype == "auto" else ""
    print(f"starting: {args.prefill} prefill + {args.decode} decode workers ({args.prefill_mode}), "
          f"model {args.model} ({dtype}{why})",
          file=sys.stderr)
    cluster.start()
    print(f"handoff cluster serving Generate on {cluster.address}"
          + (f", the OpenAI API at {cluster.http_url}" if args.http_port >= 0 else ""), file=sys.stderr)
    try:
        if args.prompt or args.message:
            if args.prompt and not args.message:
                # A prompt from the command line is a user turn of a chat, rendered by the model's template.
                args.message, args.prompt = [f"user:{args.prompt}"], None
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


if __name__ == "__main__":
    main()
