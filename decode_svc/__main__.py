"""python -m decode_svc: one decode worker (one per Kubernetes pod)."""
from common import cli
from common.worker import WorkerConfig, serve
from decode_svc.worker import DecodeWorker


def _decode_flags(parser) -> None:
    cli.add_flag(parser, "--kv-port", "HANDOFF_KV_PORT", 0,
                 "KV-transfer port (prefill workers push here; registered in Redis); 0 = a free one", int)
    cli.add_flag(parser, "--kv-memory-gib", "HANDOFF_KV_MEMORY_GIB", 1.0, "memory for the paged KV pool", float)


def main(argv=None) -> None:
    serve(DecodeWorker, WorkerConfig.from_args("decode", argv, port=50071, metrics_port=0, extra=_decode_flags))


if __name__ == "__main__":
    main()
