"""python -m decode_svc: one decode worker (one per Kubernetes pod); its flags are in common/settings.py."""
from common.worker import WorkerConfig, serve
from decode_svc.worker import DecodeWorker


def main(argv=None) -> None:
    serve(DecodeWorker, WorkerConfig.from_args("decode", argv))


if __name__ == "__main__":
    main()
