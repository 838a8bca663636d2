"""Ports picked for processes started next: outside the range the kernel gives outgoing connections."""

from __future__ import annotations

import socket

from common import ports


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable():
    low = ports._ephemeral_low()
    picked = [ports.free_port() for _ in range(50)]
    assert len(set(picked)) == len(picked)
    if low is not None and low > 2048:
        assert all(1024 <= p < low for p in picked), (low, picked)
    for port in picked[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_someone_listens_on_is_not_picked(monkeypatch):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", ports.free_port()))
        listener.listen()
        taken = listener.getsockname()[1]
        real = ports.random.randrange
        draws = iter([taken, taken])
        monkeypatch.setattr(ports.random, "randrange", lambda a, b: next(draws, None) or real(a, b))
        ports._handed_out.discard(taken)
        assert ports.free_port() != taken
