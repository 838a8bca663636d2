"""python -m router: the public entry point (one per Kubernetes pod, behind a Service)."""
import logging
import signal
import threading

from common import cli, grpc_common, metrics, security, tracing
from common.redis_server import announce_embedded, connect
from common.state import StateStore
from router.config import RouterConfig
from router.server import RouterServer

log = logging.getLogger("router")


def main(argv=None) -> None:
    config = RouterConfig.from_args(argv)
    try:
        tracing.configure("handoff-router")
    except tracing.TracingConfigError as exc:
        raise SystemExit(f"router: {exc}") from None
    client, embedded = connect(config.redis_url, password=cli.redis_password(), username=cli.redis_username())
    if embedded:
        announce_embedded(embedded, "router")
    metrics.serve_metrics(config.metrics_port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    security.reload_on_sighup()  # certificates and API keys are also re-read when they change, within a second
    try:
        server = RouterServer(config, StateStore(client)).start()
    except grpc_common.PortInUse as exc:
        raise SystemExit(f"router: {exc}") from None  # one line, no traceback
    stop.wait()
    log.info("signal received: finishing in-flight streams")
    server.stop(config.drain_timeout_s)
    tracing.close()
    if embedded:
        embedded.stop()


if __name__ == "__main__":
    main()
