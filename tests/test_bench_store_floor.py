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


def _stop(ls: socket.socket, t: threading.Thread) -> None:
    try:
        ls.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept()
    except OSError:
        pass
    ls.close()
    t.join(5)
    assert not t.is_alive()


def test_round_trips_are_timed_and_every_reply_checked():
    ls, t = _serve(echo_serve)
    try:
        lat = raw_round_trips("127.0.0.1", ls.getsockname()[1], 200)
        assert len(lat) == 200 and all(x > 0 for x in lat)
        # the server takes the next connection once the first one closed, even one
        # that went away mid-request
        with socket.create_connection(ls.getsockname()) as c:
            c.sendall(b"abc")
        assert len(raw_round_trips("127.0.0.1", ls.getsockname()[1], 3)) == 3
    finally:
        _stop(ls, t)


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
        _stop(ls, t)


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
        _stop(ls, t)


def _result(floor: dict | None) -> dict:
    from kvmesh.loadtest.bench_store_report import APIS

    def row(p50: float) -> dict:
        cell = {"ops_s": 1000.0, "gb_s": 0.004, "cpu_ms_op": 0.1, "bad": 0}
        return {a: dict(cell, p50_us=p50, p99_us=2 * p50) for a in APIS}

    res = {
        "sides": ["kvmesh", "mooncake"],
        "sizes": {"4KiB": {"kvmesh": row(200.0), "mooncake": row(150.0)}},
        "rtt_us": {"kvmesh": 40.0, "mooncake": 50.0},
        "skipped": {},
    }
    if floor is not None:
        res["floor"] = floor
    return res


def test_the_report_gives_the_floor_and_single_calls_in_floors():
    from kvmesh.loadtest.bench_store_report import goals, table

    res = _result({"p50_us": 50.0, "p99_us": 90.0, "count": 10})
    assert "4 KiB reply): p50 50 us, p99 90 us" in table(res)
    assert "(p50): kvmesh get 4.0 put 4.0, mooncake get 3.0 put 3.0" in goals(res)
    failed = _result({"error": "timed out"})
    assert "not measured (timed out)" in table(failed)
    assert "host-floor" not in goals(failed)
    assert "host floor" not in table(_result(None))
