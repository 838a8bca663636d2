"""python -m prefill_svc: one prefill worker (one per Kubernetes pod)."""
from common.redis_server import connect
from common import cli, metrics
from common.state import StateStore
from common.worker import WorkerConfig, run_until_signalled
from prefill_svc.worker import PrefillWorker


def main(argv=None) -> None:
    config = WorkerConfig.from_args("prefill", argv, port=50061, metrics_port=9101)
    client, embedded = connect(config.redis_url, password=cli.redis_password(), username=cli.redis_username())
    metrics.serve_metrics(config.metrics_port)
    try:
        run_until_signalled(PrefillWorker(config, StateStore(client)))
    finally:
        if embedded:
            embedded.stop()


if __name__ == "__main__":
    main()
