"""Hostile request bodies sent to the conductor's HTTP API while a live stream runs, and
the stream's token gaps before and meanwhile (issue 34, findings 1 and 2):

- ``int-array``: ``{"prompt": [1, 1, ...]}`` with 7.8 million token ids (15.6 MB of
  valid JSON, under the 16 MiB body limit);
- ``many-keys``: an object of a million keys (11.9 MB);
- ``gzip-bombs``: three 1 MB gzip bodies that inflate to 1 GiB each, sent to paths that
  answer without reading them: 401 (no API key; 404 when the API is open), 404 and 405.

The gaps are the times between a stream's SSE events as its client sees them; the worst
gap while the bodies are sent is held against the bound the issue sets: 100 ms, or 5x
the worst gap of the same stream just before (on a busy machine that is the larger).

    python -m kvmesh.loadtest.hostile_body --http 127.0.0.1:8000 [--api-key KEY]

prints one JSON line per kind (``tests/test_http_hostile.py`` and the fault suite's
``hostile-body`` row run the same code).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KINDS = ("int-array", "many-keys", "gzip-bombs")
GAP_FLOOR_S = 0.100  # the bound: this, or GAP_FACTOR x the baseline's worst gap
GAP_FACTOR = 5.0
TAIL_S = 1.0  # the window goes on this long after the last reply


def int_array_body(n: int = 7_800_000) -> bytes:
    """A completions body whose prompt is ``n`` token ids (15.6 MB for 7.8 million)."""
    return b'{"prompt":[' + b"1," * (n - 1) + b'1],"max_tokens":4}'


def many_keys_body(n: int = 1_000_000) -> bytes:
    """An object of ``n`` keys (11.9 MB for a million)."""
    return b"{" + b",".join(b'"k%d":0' % i for i in range(n)) + b"}"


def gzip_bomb(inflated: int = 1 << 30) -> bytes:
    """A gzip body of ~``inflated / 1000`` bytes that inflates to ``inflated`` zero bytes
    (its trailer's CRC is not the stream's: a server finds out only after inflating it
    all). Built without compressing ``inflated`` bytes: after a full flush, each MiB of
    zeros compresses to the same block."""
    c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(1 << 20)
    first = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    block = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    return first + block * (max(1, inflated >> 20) - 1) + c.flush()


def requests_of(kind: str, api_key: str) -> list[tuple[str, str, dict[str, str], bytes]]:
    """(method, path, headers, body) of the hostile requests of ``kind``."""
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    js = {"Content-Type": "application/json"}
    if kind == "int-array":
        return [("POST", "/v1/completions", {**js, **auth}, int_array_body())]
    if kind == "many-keys":
        return [("POST", "/v1/completions", {**js, **auth}, many_keys_body())]
    if kind == "gzip-bombs":
        bomb = gzip_bomb()
        gz = {**js, "Content-Encoding": "gzip"}
        first = "/v1/completions" if api_key else "/v1/no-such-path"  # 401 (no key), or 404
        return [
            ("POST", first, gz, bomb),
            ("POST", "/v1/no-such-path", {**gz, **auth}, bomb),
            ("PUT", "/v1/completions", {**gz, **auth}, bomb),
        ]
    raise ValueError(f"unknown kind {kind!r}; known: {KINDS}")


def send(addr: str, method: str, path: str, headers: dict[str, str], body: bytes) -> str:
    """One request on a fresh connection: "status: error message", or "closed (...)"
    when the server closed the connection without reading the body (its reply may be
    lost in the reset)."""
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        text = r.read()
        try:
            msg = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = text[:100].decode(errors="replace")
        return f"{r.status}: {msg}"
    except (ConnectionError, http.client.RemoteDisconnected) as e:
        return f"closed ({type(e).__name__})"
    finally:
        conn.close()


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used (0 when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class Stream(threading.Thread):
    """A streamed completion (``max_tokens`` greedy tokens, EOS ignored) whose SSE events'
    arrival times are kept; ``stop()`` closes its connection (the conductor then cancels
    it)."""

    def __init__(self, addr: str, api_key: str = "", max_tokens: int = 4000) -> None:
        super().__init__(daemon=True)
        self.addr, self.api_key, self.max_tokens = addr, api_key, max_tokens
        self.times: list[float] = []
        self.error = ""
        self.done_at: float | None = None  # when its last event ([DONE]) came
        self.first = threading.Event()
        self._conn: http.client.HTTPConnection | None = None
        self._stopping = False

    def run(self) -> None:
        host, port = self.addr.rsplit(":", 1)
        self._conn = conn = http.client.HTTPConnection(host, int(port), timeout=60)
        body = {
            "prompt": "Once upon a time",
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), headers)
            r = conn.getresponse()
            if r.status != 200:
                self.error = f"stream answered {r.status}: {r.read()[:200]!r}"
                return
            for line in r:
                if line.startswith(b"data: "):
                    self.times.append(time.perf_counter())
                    self.first.set()
                    if line.startswith(b"data: [DONE]"):
                        self.done_at = self.times[-1]
                        break
        except (OSError, http.client.HTTPException, ValueError) as e:
            if not self._stopping:
                self.error = f"stream failed: {e!r}"
        finally:
            self.first.set()

    def stop(self) -> None:
        self._stopping = True
        if self._conn is not None and self._conn.sock is not None:
            try:
                self._conn.sock.shutdown(2)
            except OSError:
                pass
        self.join(30)

    def gaps(self, t0: float, t1: float) -> list[float]:
        """The gaps between events whose second event arrived in [t0, t1], and the one
        still open at ``t1`` (a stall that outlasts the window counts too)."""
        ts = [t for t in self.times if t <= t1]
        out = [b - a for a, b in zip(ts, ts[1:]) if t0 <= b]
        if ts and (self.done_at is None or self.done_at > t1):
            out.append(t1 - max(ts[-1], t0))
        return out


def measure(addr: str, kind: str, api_key: str = "", baseline_s: float = 3.0, pid: int = 0) -> dict:
    """A stream's gaps for ``baseline_s`` before the ``kind`` bodies are sent (at once,
    each on its own connection) and while they are, until ``TAIL_S`` after the last
    reply (work a server does after replying counts too); with the conductor's ``pid``,
    its CPU time in both windows too."""
    reqs = requests_of(kind, api_key)  # built before the stream starts
    stream = Stream(addr, api_key)
    stream.start()
    try:
        if not stream.first.wait(60) or stream.error:
            raise RuntimeError(stream.error or "the stream sent nothing within 60 s")
        t_base, cpu_base = time.perf_counter(), cpu_s(pid)
        time.sleep(baseline_s)
        t0, cpu0 = time.perf_counter(), cpu_s(pid)
        replies: list[str] = [""] * len(reqs)

        def go(i: int) -> None:
            replies[i] = send(addr, *reqs[i])

        senders = [threading.Thread(target=go, args=(i,)) for i in range(len(reqs))]
        for t in senders:
            t.start()
        for t in senders:
            t.join(120)
        t1 = time.perf_counter()
        time.sleep(TAIL_S)
        t2, cpu2 = time.perf_counter(), cpu_s(pid)
    finally:
        stream.stop()
    if stream.error:
        raise RuntimeError(stream.error)
    base = stream.gaps(t_base, t0)
    during = stream.gaps(t0, t2)
    worst_base = max(base, default=0.0)
    worst = max(during, default=0.0)
    bound = max(GAP_FLOOR_S, GAP_FACTOR * worst_base)
    return {
        "kind": kind,
        "bytes": [len(r[3]) for r in reqs],
        "replies": replies,
        "send_s": round(t1 - t0, 3),
        "baseline_median_gap_s": round(statistics.median(base), 4) if base else None,
        "baseline_worst_gap_s": round(worst_base, 4),
        "worst_gap_s": round(worst, 4),
        "bound_s": round(bound, 4),
        "gaps_counted": len(during),
        "stream_ran_through": stream.done_at is None or stream.done_at >= t2,
        "cpu_s_baseline": round(cpu0 - cpu_base, 3) if pid else None,
        "cpu_s_during": round(cpu2 - cpu0, 3) if pid else None,
        # the CPU the bodies cost: what the window took beyond the baseline's rate
        "cpu_s_extra": round((cpu2 - cpu0) - (cpu0 - cpu_base) * (t2 - t0) / (t0 - t_base), 3)
        if pid
        else None,
        "bounded": len(during) > 1
        and worst <= bound
        and (stream.done_at is None or stream.done_at >= t2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvmesh.loadtest.hostile_body",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--http", required=True, help="the conductor's HTTP API, HOST:PORT")
    ap.add_argument("--api-key", default="", help="a key of the conductor's --api-keys")
    ap.add_argument("--only", default=",".join(KINDS), help=f"comma-separated of {KINDS}")
    ap.add_argument("--pid", type=int, default=0, help="the conductor's pid: its CPU time too")
    args = ap.parse_args(argv)
    ok = True
    for kind in filter(None, args.only.split(",")):
        res = measure(args.http, kind, args.api_key, pid=args.pid)
        ok = ok and res["bounded"]
        print(json.dumps(res), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
