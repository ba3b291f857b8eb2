"""The store benchmark's host floor (``loadtest.bench_store_common``): raw round trips
between two endpoints over blocking sockets, every reply checked."""

from __future__ import annotations

import socket
import threading

import pytest

from kvmesh.loadtest.bench_store_common import (
    FLOOR_REPLY,
    FLOOR_REQ,
    echo_serve,
    raw_round_trips,
)

pytestmark = pytest.mark.timeout(30)


def _serve(target) -> tuple[socket.socket, threading.Thread]:
    ls = socket.create_server(("127.0.0.1", 0))
    t = threading.Thread(target=target, args=(ls,), daemon=True)
    t.start()
    return ls, t


def test_round_trips_are_timed_and_every_reply_checked():
    ls, t = _serve(echo_serve)
    try:
        lat = raw_round_trips("127.0.0.1", ls.getsockname()[1], 200)
        assert len(lat) == 200 and all(x > 0 for x in lat)
        # the server takes the next connection once the first one closed
        assert len(raw_round_trips("127.0.0.1", ls.getsockname()[1], 3)) == 3
    finally:
        ls.close()


def test_a_wrong_reply_is_an_error_not_a_time():
    def liar(ls: socket.socket) -> None:
        s, _ = ls.accept()
        with s:
            s.recv(FLOOR_REQ)
            s.sendall(b"\x01" * FLOOR_REPLY)  # not the request repeated

    ls, t = _serve(liar)
    try:
        with pytest.raises(ValueError, match="wrongly"):
            raw_round_trips("127.0.0.1", ls.getsockname()[1], 5)
    finally:
        ls.close()


def test_a_peer_that_closes_is_an_error():
    def closer(ls: socket.socket) -> None:
        s, _ = ls.accept()
        s.recv(FLOOR_REQ)
        s.close()

    ls, t = _serve(closer)
    try:
        with pytest.raises((ValueError, ConnectionError)):
            raw_round_trips("127.0.0.1", ls.getsockname()[1], 5)
    finally:
        ls.close()
