"""Every setting of the services, once: its flag, environment variable, default, unit and the services that take it.

The config dataclasses (router/config.py, common/worker.py) take their defaults from here, every command's
parser is built from here, and docs/configuration.md is printed from here (`python -m common.settings`;
tests/test_settings.py fails when the file and the table differ). A flag always wins over its
environment variable, and the environment over the default.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from common import cli

ROUTER, PREFILL, DECODE, CLUSTER = "router", "prefill", "decode", "cluster"
SERVICES = (ROUTER, PREFILL, DECODE)
WORKERS = (PREFILL, DECODE)
EVERY = (ROUTER, PREFILL, DECODE, CLUSTER)  # CLUSTER = python -m router.cluster, every service in one process

DTYPES = ("auto", "fp32", "bf16", "fp16")
PREFILL_MODES = ("disaggregated", "colocated", "conditional")
ROUTINGS = ("cache_aware", "least_loaded")
DENSE_WEIGHTS = ("auto", "keep", "lazy")
GENERATION_CONFIGS = ("auto", "none")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

def _level(text: str) -> str:
    return text.upper()


_UNITS = (("_s", "seconds"), ("_gib", "GiB"), ("_bytes", "bytes"), ("_tokens", "tokens"), ("_port", "port"))


@dataclass(frozen=True)
class Setting:
    name: str  # the config field; the flag is --name-with-dashes
    default: object  # one value, or {service: value} where the services differ
    help: str
    services: tuple[str, ...]
    type: type = str
    choices: tuple[str, ...] = ()
    env: str = ""  # unset = HANDOFF_<NAME>

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env_name(self) -> str:
        return self.env or "HANDOFF_" + self.name.upper()

    @property
    def unit(self) -> str:
        if self.type is bool:
            return "true/false"
        return next((unit for suffix, unit in _UNITS if self.name.endswith(suffix) or self.name == suffix[1:]), "")

    def default_for(self, service: str):
        if isinstance(self.default, dict):
            return self.default.get(service, self.default.get("*"))
        return self.default


def _s(name, default, help, services, type=str, choices=(), env="") -> Setting:
    return Setting(name, default, help, tuple(services), type, tuple(choices), env)


SETTINGS: tuple[Setting, ...] = (
    # Where a service listens and what it serves.
    _s("host", "0.0.0.0", "address to listen on", SERVICES),
    _s("port", {ROUTER: 50051, PREFILL: 50061, DECODE: 50071, CLUSTER: 50051},
       "gRPC port (router.cluster: the router's Generate port; its workers take free ones)", EVERY, int),
    _s("http_port", 8000, "the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
       "/health; metrics are on --metrics-port alone); 0 = a free port, -1 = off", (ROUTER, CLUSTER), int),
    _s("kv_port", 0, "KV-transfer port (prefill workers push here; registered in Redis); 0 = a free one",
       (DECODE,), int),
    _s("metrics_port", {ROUTER: 9100, PREFILL: 0, DECODE: 0},
       "Prometheus /metrics HTTP port; 0 = a free one (a worker registers it in Redis), -1 = off", SERVICES, int),
    _s("health_port", 0, "a plaintext port serving only grpc.health.v1, for probes that cannot speak TLS; 0 = off",
       SERVICES, int),
    _s("advertise_host", None, "host other services reach this worker at (a pod sets it from status.podIP); "
       "unset = this machine's hostname", WORKERS),
    _s("worker_id", None, "registry id; unset = <role>-<host>-<port>", WORKERS),
    _s("redis_url", None, "Redis URL (redis://host:port/db, rediss:// for TLS; the password comes from "
       "REDIS_PASSWORD); unset = start an embedded Redis server in this process and log its URL for the other "
       "services", EVERY, env="REDIS_URL"),
    _s("redis_acl", False, "the embedded Redis gets one ACL user per role (common/redis_acl.py) and each service "
       "connects as its own; the operator's credentials go to a 0600 file whose path is printed, for python -m "
       "router.status", (CLUSTER,), bool),
    _s("log_level", "INFO", "logging level", EVERY, _level, LOG_LEVELS),
    # The model and how it is computed.
    _s("model", "smollm2", "a .gguf file, an HF checkpoint folder, or a short name (smollm2)", EVERY),
    _s("served_model_name", "", "the model name(s) the OpenAI API answers to, comma-separated: /v1/models "
       "lists them, a request's model must be one of them, responses report the first; empty = the model's own "
       "name (smollm2, a .gguf file's stem, an HF folder's name)", (ROUTER, CLUSTER)),
    _s("dtype", "auto", "weights and KV dtype: auto (bf16 on CUDA and on CPUs with native bf16 matmuls, "
       "AVX512_BF16 or AMX; else fp32); prefill and decode pools must agree", (*WORKERS, CLUSTER), choices=DTYPES),
    _s("device", "cpu", "torch device: cpu or cuda[:N]", (*WORKERS, CLUSTER)),
    _s("threads", 0, "torch intra-op threads; 0 = this process's cores shared among its engines (a worker has "
       "one: all cores; router.cluster: cores / workers)", (*WORKERS, CLUSTER), int),
    _s("packed_decode", True, "decode with the GGUF's packed weights as stored (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, "
       "Q6_K); false = the dtype's dense matmuls", (*WORKERS, CLUSTER), bool),
    _s("dense_weights", "auto", "dense copies of the packed matrices for prefill's GEMMs: keep (held from load), "
       "lazy (made from the file layer by layer when a prefill runs: the pod's memory is the file plus the KV "
       "pool, prefill is slower) or auto (prefill workers keep; decode workers lazy: set keep on decode workers "
       "that prefill, colocated or conditional; router.cluster's workers share one model that keeps them)",
       WORKERS, choices=DENSE_WEIGHTS),
    # The engine's batches and pools.
    _s("max_running", 64, "sequences an engine runs at once (the decode batch, prompts being prefilled "
       "included); more wait in its queue", (*WORKERS, CLUSTER), int),
    _s("max_prefill_tokens", 2048, "prompt tokens one engine step prefills at most (a whole number of "
       "--prefill-chunk-tokens chunks)", (*WORKERS, CLUSTER), int),
    _s("prefill_chunk_tokens", 256, "prompts are prefilled in chunks of this many tokens at fixed positions, "
       "and the K/V of whole chunks is reused by prompts that share them; a multiple of the block size, the "
       "same on every worker", (*WORKERS, CLUSTER), int),
    _s("prefix_caching", True, "keep the K/V of prompt chunks for later prompts with the same prefix",
       (*WORKERS, CLUSTER), bool),
    _s("kv_memory_gib", 1.0, "memory for a decode worker's paged KV pool (router.cluster: per decode worker)",
       (DECODE, CLUSTER), float),
    _s("prefill_kv_tokens", 16384, "a prefill worker's own KV pool, in tokens: it holds prompts only while "
       "they are computed and pushed", (PREFILL, CLUSTER), int),
    _s("stream_kv", True, "push a prompt's K/V to its decode worker chunk by chunk while the prefill computes "
       "the rest (prompts longer than one --prefill-chunk-tokens chunk); false = push it all after the first "
       "token", (PREFILL, CLUSTER), bool),
    _s("kv_wait_s", 30.0, "how long a request's KV and its Decode call wait for each other on a decode "
       "worker: the router sends its value with each request; a decode worker's own bounds it, and KV that "
       "arrives before its call",
       (ROUTER, DECODE, CLUSTER), float),
    # The router: placement, admission and limits.
    _s("prefill_mode", "disaggregated", "where prompts are prefilled: disaggregated (on a prefill worker, KV "
       "pushed to the decode worker), colocated (on the decode worker itself; no prefill pool needed) or "
       "conditional (on a prefill worker from --remote-prefill-min-tokens prompt tokens on, else colocated)",
       (ROUTER, CLUSTER), choices=PREFILL_MODES),
    # 64 from `python -m bench.token_path --only placement` on 2 CPU cores (docs/operations.md): from 32-64
    # prompt tokens on, remote prefill gave a TTFT within 1.1x of local (the push's fixed cost) and stalled a
    # decoding stream 34-61 ms instead of the whole prefill (124-183 ms at 32-64 tokens, 2.3 s at 1,024).
    _s("remote_prefill_min_tokens", 64, "conditional: the shortest prompt (in tokens) prefilled on a prefill "
       "worker (measure yours: python -m bench.token_path --only placement)", (ROUTER, CLUSTER), int),
    # At 3, a remote TTFT stays within about 4x of the prompt's own prefill (Dynamo's prefill-queue limit,
    # in tokens).
    _s("remote_prefill_max_queue_ratio", 3.0, "conditional: prefill on the decode worker a prompt that would "
       "queue behind more than this many times its length in prompts no longer than it on the least loaded "
       "prefill worker (0 = off)", (ROUTER, CLUSTER), float),
    # Measured: one 1,536-token prompt placed on a decode worker made all 5 requests of a point miss TPOT.
    _s("remote_prefill_queue_max_tokens", 512, "conditional: the longest prompt the queue rule may send to "
       "the decode worker (longer ones stop its streams for seconds)", (ROUTER, CLUSTER), int),
    _s("routing", "cache_aware", "prefill worker choice: cache_aware (the longest cached prompt prefix, "
       "unless that worker is busier than the least loaded by more than --cache-balance) or least_loaded",
       (ROUTER, CLUSTER), choices=ROUTINGS),
    _s("cache_balance", 4, "cache_aware: requests in flight a worker may have beyond the least loaded one",
       (ROUTER, CLUSTER), int),
    _s("queue_timeout_s", 5.0, "how long a request may wait for decode capacity", (ROUTER, CLUSTER), float),
    _s("max_queued", 128, "requests allowed to wait for capacity; beyond, RESOURCE_EXHAUSTED (429) at once",
       (ROUTER, CLUSTER), int),
    _s("lease_ttl_s", 10.0, "KV reservation lease: a dead router's reservations come back within this",
       (ROUTER, CLUSTER), float),
    _s("generation_config", "auto", "auto: the sampling settings the model's files carry (an HF folder's "
       "generation_config.json, a GGUF's general.sampling.*) fill a request's unset temperature, top_p, top_k, "
       "min_p, repetition_penalty and max_tokens, as vLLM's --generation-config auto does; none: handoff's own "
       "defaults (protos/handoff.proto)", (ROUTER, CLUSTER), choices=GENERATION_CONFIGS),
    _s("default_max_tokens", 256, "max_tokens of a request that sets none (and whose model files set none)",
       (ROUTER, CLUSTER), int),
    _s("max_request_s", 600.0, "the deadline of a request whose client sets none", (ROUTER, CLUSTER), float),
    _s("max_attempts", 3, "tries of one request across workers (the retry budget of failover)",
       (ROUTER, CLUSTER), int),
    _s("max_streams", 4096, "Generate streams in flight per port (gRPC, HTTP); beyond, RESOURCE_EXHAUSTED "
       "(429) at once", (ROUTER, CLUSTER), int),
    _s("max_messages", 256, "chat messages in one request", (ROUTER, CLUSTER), int),
    _s("max_body_bytes", 4 << 20, "the largest HTTP request body; more is 413", (ROUTER, CLUSTER), int),
    _s("drain_timeout_s", 25.0, "on SIGTERM, how long in-flight requests may take to finish", SERVICES, float),
    # Security: files only (a mounted Secret); secrets themselves come from the environment, never a flag.
    _s("tls_cert", None, "this service's certificate chain (PEM), of its role (URI SAN spiffe://handoff/<namespace>"
       "/role/<role>, DNS <role>.<--tls-server-name>; python -m common.pki issues them): served on its ports and "
       "presented as client certificate; re-read when it changes; none of the TLS files set = plaintext everywhere",
       SERVICES),
    _s("tls_key", None, "the private key of --tls-cert", SERVICES),
    _s("tls_ca", None, "CA bundle that peers' certificates must chain to; internal ports then require client "
       "certificates", SERVICES),
    _s("tls_server_name", None, "the internal name: a server of role R must carry the DNS name R.<this> (workers "
       "register IPs, which no certificate names); unset = handoff-internal", SERVICES),
    _s("public_tls_cert", None, "the certificate of the router's public ports (PEM; re-read when it changes); "
       "unset = --tls-cert, the router's internal identity", (ROUTER,)),
    _s("public_tls_key", None, "the private key of --public-tls-cert", (ROUTER,)),
    _s("tls_require_client_cert", False, "also require client certificates on the public port (otherwise API "
       "keys authenticate)", (ROUTER,), bool),
    _s("api_keys_file", None, "file of API keys clients must send as 'authorization: Bearer <key>' (one per "
       "line, # comments); keys may also come comma-separated in HANDOFF_API_KEYS; none = no key needed",
       (ROUTER, CLUSTER)),
)

# Read from the environment only: flags show in `ps`, these must not.
SECRETS = (
    ("REDIS_PASSWORD", "the Redis password (a Kubernetes Secret)", EVERY),
    ("REDIS_USERNAME", "the Redis ACL user; unset = the default user", EVERY),
    ("HANDOFF_API_KEYS", "comma-separated API keys, beside --api-keys-file", (ROUTER, CLUSTER)),
)

# The engine's switches, read from the environment where they are used (common/engine/): for diagnosis
# and for images, not for tuning.
ENGINE_ENVIRONMENT = (
    ("HANDOFF_NATIVE_MATMUL", "how decode's packed-weight matmuls run; unset = chosen by the CPU "
     "(common/engine/native/choice.py names the choices)"),
    ("HANDOFF_NATIVE_ATTENTION", "0 = no native library: torch ops everywhere (slow; for diagnosis)"),
    ("HANDOFF_NATIVE_LIBRARY", "a prebuilt kernel library to load instead of compiling one (the image sets it)"),
    ("HANDOFF_NATIVE_CACHE", "where compiled kernel libraries are kept (default ~/.cache/handoff/native)"),
    ("HANDOFF_HUGE_PAGES", "0 = 4 KiB pages for the packed weights and the KV pool (default: transparent huge "
     "pages where the kernel offers them)"),
)

# OpenTelemetry's standard variables that turn tracing on and shape it, read by common/tracing.py and the
# OpenTelemetry SDK (docs/operations.md, "Tracing"). Not HANDOFF_ settings: the names and meanings are the
# specification's, so a collector's usual configuration applies.
TRACING_ENVIRONMENT = (
    ("OTEL_TRACES_EXPORTER", "`otlp` (and/or `console`) turns tracing on, `none` off; unset = on only when an "
     "OTLP endpoint is set (the specification's default is otlp: handoff's is off)"),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "the collector's OTLP/gRPC address (`http://host:4317`; http = plaintext); "
     "setting it alone turns tracing on. `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` wins over it"),
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "`grpc` only (the default); another value stops the service at start. "
     "Also `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`"),
    ("OTEL_SERVICE_NAME", "the service name spans carry; unset = handoff-router, handoff-prefill, handoff-decode "
     "or handoff-cluster"),
    ("OTEL_SDK_DISABLED", "`true` = tracing off whatever else is set"),
    ("OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER(_ARG), OTEL_BSP_*, OTEL_EXPORTER_OTLP_(TRACES_)HEADERS / "
     "_CERTIFICATE / _CLIENT_KEY / _CLIENT_CERTIFICATE / _COMPRESSION / _TIMEOUT / _INSECURE",
     "as the OpenTelemetry SDK reads them: resource attributes, sampling (default parentbased_always_on: a "
     "caller's unsampled trace stays unsampled), the batch exporter's queue and delay, the exporter's "
     "headers, TLS, compression and timeout"),
)

BY_NAME = {s.name: s for s in SETTINGS}


def default(name: str, service: str = "*"):
    """A setting's default, for a config dataclass's field."""
    return BY_NAME[name].default_for(service)


def for_service(service: str) -> list[Setting]:
    return [s for s in SETTINGS if service in s.services]


def add_to(parser: argparse.ArgumentParser, service: str) -> None:
    """Every setting `service` takes, with the environment's values as defaults."""
    for s in for_service(service):
        parser.add_argument(s.flag, **_argument(parser, s, s.default_for(service)))


def _argument(parser: argparse.ArgumentParser, s: Setting, default) -> dict:
    raw = cli.env(s.env_name)
    parse = cli.boolean if s.type is bool else s.type
    value = default
    if raw is not None:
        try:
            value = parse(raw)
        except ValueError:
            parser.error(f"environment variable {s.env_name}={raw!r} is not a valid {s.unit or s.type.__name__}")
        if s.choices and value not in s.choices:
            parser.error(f"environment variable {s.env_name}={raw!r} is not one of {', '.join(s.choices)}")
    help = f"{s.help} (env {s.env_name}; default {_shown(default)})"
    if s.type is bool:  # --flag alone = true; --flag false / --flag=false as on the environment
        return dict(type=cli.boolean, nargs="?", const=True, default=value, metavar="true|false", help=help)
    return dict(type=s.type, default=value, choices=s.choices or None, help=help)


def _shown(value) -> str:
    if value is None or value == "":
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def reference() -> str:
    """docs/configuration.md: one table per group of services."""
    lines = [
        "# Configuration reference",
        "",
        "Printed by `python -m common.settings` from the table the services' parsers are built from",
        "(`common/settings.py`); `tests/test_settings.py` fails when this file and the code differ. Every",
        "setting is a flag and an environment variable; a flag wins over the variable, the variable over",
        "the default. Booleans read `true`/`false` (also 1/0, yes/no, on/off) as values of the flag or the",
        "variable, and a boolean flag alone means true. `--help` of each command lists the same. On Kubernetes",
        "the Deployments set the variables from the `handoff-config` ConfigMap (docs/deploy.md).",
        "",
        "Services: **router** = `python -m router`, **prefill** = `python -m prefill_svc`, **decode** =",
        "`python -m decode_svc`, **cluster** = `python -m router.cluster` (every service in one process; its",
        "`--port` is the router's, its workers take free ports).",
        "",
        "| flag | environment | default | unit | services | what it sets |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for s in SETTINGS:
        defaults = {svc: s.default_for(svc) for svc in s.services}
        if len({repr(v) for v in defaults.values()}) == 1:
            shown = f"`{_shown(next(iter(defaults.values())))}`"
        else:
            shown = ", ".join(f"{svc} `{_shown(v)}`" for svc, v in defaults.items())
        choices = f" One of: {', '.join(f'`{c}`' for c in s.choices)}." if s.choices else ""
        help = s.help.replace("|", "\\|")
        lines.append(f"| `{s.flag}` | `{s.env_name}` | {shown} | {s.unit} | {', '.join(s.services)} | "
                     f"{help}.{choices} |")
    lines += ["", "Secrets, read from the environment only (flags show in `ps`):", "",
              "| environment | services | what it is |", "| --- | --- | --- |"]
    lines += [f"| `{name}` | {', '.join(services)} | {what} |" for name, what, services in SECRETS]
    lines += ["", "The engine's switches, read from the environment by every process that runs an engine (prefill, "
              "decode, cluster): for diagnosis and images, not tuning:", "",
              "| environment | what it does |", "| --- | --- |"]
    lines += [f"| `{name}` | {what} |" for name, what in ENGINE_ENVIRONMENT]
    lines += ["", "Tracing, OpenTelemetry's standard variables, read by every service (docs/operations.md, "
              "\"Tracing\"); with none of them set no service traces:", "",
              "| environment | what it does |", "| --- | --- |"]
    lines += [f"| `{name}` | {what} |" for name, what in TRACING_ENVIRONMENT]
    lines += ["", "`python -m router.cluster` also takes `--prefill` and `--decode` (how many workers of each "
              "pool) and the request flags of `python -m router.client` (`--prompt`, `--message`, sampling) "
              "to answer one request and exit.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(reference())
