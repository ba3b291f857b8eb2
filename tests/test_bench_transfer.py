"""bench_transfer, run small as a real pair of processes: the plain-stream baseline uses
as many connections as the engine, and every byte moved (engine writes and reads, each
stream run) is verified, not one slice at the end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)


def test_stream_baseline_matches_conns_and_every_byte_is_verified(tmp_path):
    out = tmp_path / "transfer.json"
    argv = [sys.executable, "-m", "kvmesh.loadtest.bench_transfer", "--total-mib", "64"]
    argv += ["--reps", "1", "--conns", "3", "--no-mooncake", "--max-point-s", "0.2"]
    r = subprocess.run([*argv, "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["stream_conns"] == res["conns_per_peer"] == 3
    # each point moves a full 64 MiB in batched mode, twice (write, read) per block size
    assert res["verified_bytes"] >= 4 * 2 * (64 << 20)
    assert "3 conns" in r.stdout and "verified: every byte moved" in r.stdout
