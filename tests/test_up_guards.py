"""``kvmesh up`` guards its workdir and its flags (issue 34, findings 4, 6 and 9), with
real ``kvmesh up`` processes:

- one cluster per workdir: a second ``kvmesh up`` on a live cluster's workdir (on other
  ports) exits at once naming the PID that holds it, and the first cluster's etcd data,
  secret, logs and processes are untouched and it still serves;
- a well-known ``KVMESH_SECRET`` is replaced with a warning that says so;
- when supervision gives up, "giving up" is said once;
- every flag's range is checked at parse time: a usage error (exit 2) naming the flag
  and its range, never a traceback or a "cluster not ready" 90 s later;
- the start-up line counts the conductors and store-masters it starts.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvmesh.services.common.tokenizer import ByteTokenizer
from kvmesh.services.engine.model import LlamaModel
from kvmesh.services.launcher import LocalCluster, WorkdirInUse, WorkdirLock
from kvmesh.services.launcher.up import add_up_arguments, starting_line
from tests.cluster_util import generate

CLI = [sys.executable, "-m", "kvmesh.services.cli"]
UP = [*CLI, "up", "--port", "0", "--http-port", "-1", "--block-size", "16"]
READY = "Ctrl-C stops the cluster"


def _wait_line(log: Path, needle: str, proc: subprocess.Popen, timeout: float = 150) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if needle in text:
            return text
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{text}"
        time.sleep(0.2)
    pytest.fail(f"no {needle!r} in {timeout}s:\n{log.read_text(errors='replace')}")


def _children(pid: int) -> dict[int, str]:
    """The processes ``pid`` started, with their command lines."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    kids = {}
    for x in out.stdout.split():
        try:
            kids[int(x)] = Path(f"/proc/{x}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            pass
    return kids


def _pid_of(up_pid: int, node_id: str, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid, cmd in _children(up_pid).items():
            if f"\0{node_id}\0" in cmd:
                return pid
        time.sleep(0.1)
    pytest.fail(f"no {node_id} under {up_pid}")


def test_second_up_on_a_live_workdir_is_refused_and_the_first_keeps_serving(tmp_path):
    work, log = tmp_path / "w", tmp_path / "up1.log"
    env = dict(os.environ, KVMESH_SECRET="kvmesh-dev-secret")
    with open(log, "wb") as out:
        first = subprocess.Popen(
            [*UP, "--workdir", str(work), "--max-restarts", "1"],
            stdout=out,
            stderr=out,
            env=env,
        )
    kids: dict[int, str] = {}
    try:
        text = _wait_line(log, READY, first)
        conductor = re.search(r"conductor at (\S+?),? etcd", text).group(1).split(",")[0]
        # the well-known secret was replaced, and the warning says so and where the real one is
        secret = (work / "secret").read_text()
        assert secret.strip() != "kvmesh-dev-secret"
        assert "KVMESH_SECRET is the well-known 'kvmesh-dev-secret'" in text, text
        assert f"{work}/secret" in text
        kids = _children(first.pid)
        etcd_files = sorted(str(p) for p in (work / "etcd").rglob("*"))
        logs = {p.name: p.read_bytes() for p in work.glob("*.log")}
        assert etcd_files and len(logs) >= 5

        t = time.monotonic()
        second = subprocess.run(
            [*UP, "--workdir", str(work)], capture_output=True, text=True, timeout=120
        )
        took = time.monotonic() - t
        assert second.returncode == 1, second.stdout + second.stderr
        assert f"pid {first.pid}" in second.stderr and "in use" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr
        assert took < 30, took  # refused at once, not after starting anything

        # the first cluster: same secret, etcd data, logs (only grown) and processes
        assert (work / "secret").read_text() == secret
        assert set(etcd_files) <= {str(p) for p in (work / "etcd").rglob("*")}
        for name, before in logs.items():
            assert (work / name).read_bytes().startswith(before), name
        assert {p.name for p in work.glob("*.log")} == set(logs)
        assert set(_children(first.pid)) == set(kids)
        prompt = "One cluster per workdir."
        model, tok = LlamaModel.from_preset("tiny", seed=0), ByteTokenizer()
        want = model.reference_generate(tok.encode(prompt), 8, eos_id=tok.eos_id)
        assert generate(conductor, prompt, max_tokens=8).tokens == want

        # supervision gives up after --max-restarts 1: said once, and the lock goes with it
        decode = _pid_of(first.pid, "decode-0")
        os.kill(decode, signal.SIGKILL)
        _wait_line(log, "restarted decode-0", first, 60)
        os.kill(_pid_of(first.pid, "decode-0"), signal.SIGKILL)
        assert first.wait(90) == 1, log.read_text()
        text = log.read_text()
        assert text.count("giving up") == 1, text[-3000:]
        assert "stopping the cluster" in text
        lock = WorkdirLock(str(work))
        lock.acquire()  # free again
        lock.release()
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGINT)
            try:
                first.wait(60)
            except subprocess.TimeoutExpired:
                first.kill()
                first.wait()
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def test_the_workdir_lock_names_its_holder_and_is_let_go_on_stop(tmp_path):
    """The launcher API ``kvmesh up`` uses: a second LocalCluster on a held workdir
    raises before it writes anything there (not even the secret)."""
    first = LocalCluster(str(tmp_path))
    secret = (tmp_path / "secret").read_bytes()
    try:
        with pytest.raises(WorkdirInUse, match=f"pid {os.getpid()} holds"):
            LocalCluster(str(tmp_path))
        assert (tmp_path / "secret").read_bytes() == secret
    finally:
        first.stop(grace=1)
    LocalCluster(str(tmp_path)).stop(grace=1)  # free once the first has stopped


BAD = [
    (["--port", "70000"], "--port", "from 0 to 65535"),
    (["--port", "-1"], "--port", "from 0 to 65535"),
    (["--http-port", "-2"], "--http-port", "from -1 to 65535"),
    (["--http-port", "65536"], "--http-port", "from -1 to 65535"),
    (["--prefill", "-1"], "--prefill", ">= 1"),
    (["--prefill", "0"], "--prefill", ">= 1"),
    (["--decode", "0"], "--decode", ">= 1"),
    (["--conductors", "0"], "--conductors", ">= 1"),
    (["--store-masters", "0"], "--store-masters", ">= 1"),
    (["--max-restarts", "-1"], "--max-restarts", ">= 0"),
    (["--restart-window", "-5"], "--restart-window", "> 0"),
    (["--restart-window", "0"], "--restart-window", "> 0"),
    (["--restart-window", "nan"], "--restart-window", "> 0"),
    (["--block-size", "0"], "--block-size", "from 1 to 4096"),
    (["--nodes", "-1"], "--nodes", ">= 0"),
    (["--cpus", "-0.5"], "--cpus", ">= 0"),
    (["--max-tokens", "0"], "--max-tokens", "from 1 to 2147483647"),
    (["--conductors", "two"], "--conductors", "not an integer"),
]


@pytest.mark.parametrize(("args", "option", "hint"), BAD, ids=[" ".join(a) for a, _, _ in BAD])
def test_bad_up_flags_are_usage_errors(args, option, hint, tmp_path):
    t = time.monotonic()
    out = subprocess.run(
        [*CLI, "up", "--workdir", str(tmp_path / "w"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert f"argument {option}:" in out.stderr and hint in out.stderr, out.stderr
    assert not (tmp_path / "w").exists()  # nothing started
    assert time.monotonic() - t < 30


def test_health_wait_must_not_be_negative():
    out = subprocess.run(
        [*CLI, "health", "127.0.0.1:1", "--wait", "-1"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "argument --wait:" in out.stderr, out.stderr


def test_documented_edge_values_parse():
    p = argparse.ArgumentParser()
    add_up_arguments(p)
    a = p.parse_args(
        ["--port", "0", "--http-port", "-1", "--max-restarts", "0", "--nodes", "0"]
        + ["--cpus", "0", "--restart-window", "0.5", "--block-size", "4096"]
    )
    assert (a.port, a.http_port, a.max_restarts, a.nodes) == (0, -1, 0, 0)
    assert (a.cpus, a.restart_window, a.block_size) == (0.0, 0.5, 4096)
    a = p.parse_args(["--port", "65535", "--http-port", "65535", "--conductors", "3"])
    assert (a.port, a.http_port, a.conductors) == (65535, 65535, 3)


def test_the_starting_line_counts_conductors_and_store_masters(tmp_path):
    c = LocalCluster(str(tmp_path), conductors=2, store_masters=3, prefill=2, decode=1)
    try:
        line = starting_line(c)
    finally:
        c.stop(grace=1)
    assert line.startswith(
        "starting etcd, 3 store-masters, 2 conductors, 2 prefill and 1 decode node(s)"
    ), line
    c = LocalCluster(str(tmp_path))
    try:
        assert starting_line(c).startswith("starting etcd, store-master, conductor, 1 prefill")
    finally:
        c.stop(grace=1)


SERVICE_BAD = [
    (["store-master", "--fast-port", "99999"], "fast_port: 99999 is not a TCP port"),
    (["conductor", "--http-port", "70000"], "http_port: 70000 is not a TCP port"),
    (["conductor", "--grace-s", "nan"], "grace_s: 'nan' is not a finite number"),
    (["conductor", "--ttft-slo-ms", "inf"], "ttft_slo_ms: 'inf' is not a finite number"),
]


@pytest.mark.parametrize(("args", "hint"), SERVICE_BAD, ids=[" ".join(a) for a, _ in SERVICE_BAD])
def test_bad_service_numbers_are_refused_at_start_with_the_reason(args, hint):
    """The services check their options after merging flags, KVMESH_* and the config file:
    a bad number is their start-up error naming it (exit 1), before etcd is dialled; the
    fast port was an OverflowError traceback from bind(), the HTTP port and a NaN were
    taken (etcd then timed out)."""
    out = subprocess.run(
        [*CLI, *args, "--etcd", "127.0.0.1:1"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and hint in out.stderr, out.stderr
