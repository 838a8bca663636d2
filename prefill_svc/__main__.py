"""python -m prefill_svc: one prefill worker (one per Kubernetes pod); its flags are in common/settings.py."""
from common.worker import WorkerConfig, serve
from prefill_svc.worker import PrefillWorker


def main(argv=None) -> None:
    serve(PrefillWorker, WorkerConfig.from_args("prefill", argv))


if __name__ == "__main__":
    main()
