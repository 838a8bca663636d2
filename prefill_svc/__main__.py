"""python -m prefill_svc: one prefill worker (one per Kubernetes pod)."""
from common.worker import WorkerConfig, serve
from prefill_svc.worker import PrefillWorker


def main(argv=None) -> None:
    serve(PrefillWorker, WorkerConfig.from_args("prefill", argv, port=50061, metrics_port=0))


if __name__ == "__main__":
    main()
