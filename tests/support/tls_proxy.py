"""A TLS endpoint in front of a plaintext TCP server: a real Redis reached over rediss://, as a managed
Redis is, although the bundled valkey-server is built without TLS."""
from __future__ import annotations

import select
import socket
import ssl
import threading
from pathlib import Path


class TLSProxy:
    """Listens on 127.0.0.1 with `cert`/`key`, and relays each TLS connection, decrypted, to
    127.0.0.1:`target_port`. One thread per connection does both directions, so an SSL object is
    never used by two threads at once."""

    def __init__(self, target_port: int, cert: Path, key: Path) -> None:
        self.target_port = target_port
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._context.load_cert_chain(str(cert), str(key))
        self._listener: socket.socket | None = None
        self._stopped = threading.Event()
        self.num_handshakes = 0  # completed TLS handshakes
        self.num_refused = 0  # connections whose handshake failed (plaintext, or the client refused the certificate)

    @property
    def port(self) -> int:
        assert self._listener is not None, "start() first"
        return self._listener.getsockname()[1]

    def start(self) -> TLSProxy:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        threading.Thread(target=self._accept, name="tls-proxy", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._listener is not None:
            self._listener.close()

    def __enter__(self) -> TLSProxy:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed by stop()
            threading.Thread(target=self._relay, args=(conn,), name="tls-proxy-conn", daemon=True).start()

    def _relay(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        try:
            tls = self._context.wrap_socket(conn, server_side=True)
        except (ssl.SSLError, OSError):
            self.num_refused += 1
            conn.close()
            return
        self.num_handshakes += 1
        with tls, socket.create_connection(("127.0.0.1", self.target_port), timeout=5) as plain:
            while not self._stopped.is_set():
                # Bytes already decrypted inside the SSL object do not show up in select().
                ready = [tls] if tls.pending() else select.select([tls, plain], [], [], 0.2)[0]
                for source in ready:
                    sink = plain if source is tls else tls
                    try:
                        data = source.recv(65536)
                        if not data:
                            return
                        sink.sendall(data)
                    except OSError:
                        return
