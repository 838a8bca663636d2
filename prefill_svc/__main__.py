"""python -m prefill_svc: one prefill worker (one per Kubernetes pod)."""
from common import cli
from common.worker import WorkerConfig, serve
from prefill_svc.worker import PrefillWorker


def _flags(parser) -> None:
    cli.add_flag(parser, "--stream-kv", "HANDOFF_STREAM_KV", True,
                 "push a prompt's K/V to its decode worker chunk by chunk while the prefill computes the rest "
                 "(prompts longer than one --prefill-chunk-tokens chunk); false = push it all after the first "
                 "token", cli.parse_bool)


def main(argv=None) -> None:
    serve(PrefillWorker, WorkerConfig.from_args("prefill", argv, port=50061, metrics_port=0, extra=_flags))


if __name__ == "__main__":
    main()
