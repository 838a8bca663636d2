"""Ports for processes started next: picked here, bound there a moment later."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()


def _ephemeral_low() -> int | None:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing on host listens on, for a process started next to bind, never the same twice in
    this process. Drawn below the kernel's ephemeral range: the kernel takes the local port of every
    outgoing connection from that range, so asking it for a free port (bind to 0) hands out one that a
    client socket may take before the new process binds it ("Address already in use", seen in CI when
    a worker's side port went to a connection to Redis). Below the range, only another listener can."""
    low = _ephemeral_low()
    if low is not None and low > 2048:
        first = max(1024, low - 16384)
        for _ in range(200):
            port = random.randrange(first, low)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
    while True:  # no Linux range to stay below: the kernel's pick
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
