"""python -m decode_svc: one decode worker (one per Kubernetes pod)."""
from common import cli, metrics
from common.redis_server import connect
from common.state import StateStore
from common.worker import WorkerConfig, run_until_signalled
from decode_svc.worker import DecodeWorker


def _decode_flags(parser) -> None:
    cli.add_flag(parser, "--kv-port", "HANDOFF_KV_PORT", 50072, "KV-transfer port (prefill workers push here)", int)
    cli.add_flag(parser, "--kv-memory-gib", "HANDOFF_KV_MEMORY_GIB", 1.0, "memory for the paged KV pool", float)


def main(argv=None) -> None:
    config = WorkerConfig.from_args("decode", argv, port=50071, metrics_port=9102, extra=_decode_flags)
    client, embedded = connect(config.redis_url, password=cli.redis_password(), username=cli.redis_username())
    metrics.serve_metrics(config.metrics_port)
    try:
        run_until_signalled(DecodeWorker(config, StateStore(client)))
    finally:
        if embedded:
            embedded.stop()


if __name__ == "__main__":
    main()
