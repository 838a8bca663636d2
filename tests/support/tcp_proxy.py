"""A plain TCP relay in front of a real server that can be cut: what an unreachable Redis looks like to the
clients behind it (a partition, a Redis moved or restarting), while the server and its other clients go on."""
from __future__ import annotations

import select
import socket
import threading


class CutProxy:
    """Listens on 127.0.0.1 and relays each connection to 127.0.0.1:`target_port`. cut() closes every relayed
    connection and closes new ones at once, until mend(): the clients see their connections refused or
    reset, as when the server cannot be reached."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener: socket.socket | None = None
        self._stopped = threading.Event()
        self._cut = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()

    @property
    def url(self) -> str:
        assert self._listener is not None, "start() first"
        return f"redis://127.0.0.1:{self._listener.getsockname()[1]}/0"

    def start(self) -> CutProxy:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        threading.Thread(target=self._accept, name="cut-proxy", daemon=True).start()
        return self

    def cut(self) -> None:
        self._cut.set()
        with self._lock:
            conns, self._conns = self._conns, set()
        for conn in conns:
            _close(conn)

    def mend(self) -> None:
        self._cut.clear()

    def stop(self) -> None:
        self._stopped.set()
        self.cut()
        if self._listener is not None:
            self._listener.close()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed by stop()
            if self._cut.is_set():
                _close(conn)
                continue
            threading.Thread(target=self._relay, args=(conn,), name="cut-proxy-conn", daemon=True).start()

    def _relay(self, conn: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
        except OSError:
            _close(conn)
            return
        with self._lock:
            self._conns |= {conn, upstream}
        try:
            while not self._stopped.is_set() and not self._cut.is_set():
                for source in select.select([conn, upstream], [], [], 0.2)[0]:
                    data = source.recv(65536)
                    if not data:
                        return
                    (upstream if source is conn else conn).sendall(data)
        except (OSError, ValueError):  # closed by cut()
            return
        finally:
            _close(conn)
            _close(upstream)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
