"""A local cluster supervises its processes (issue 18, items 2 and 8), with real
``kvmesh up`` processes, real etcd and real services:

- SIGKILL of ``kvmesh up`` leaves no child alive (each is tied to it by a parent-death
  signal);
- a node killed with SIGKILL is restarted, registers again and serves the right tokens;
  when its restarts run out the cluster says so;
- SIGINT stops ``kvmesh up`` started in the background by a script (SIGINT ignored), and
  a second signal during the teardown still leaves no process and no etcd data behind;
- ``--tls`` gives the embedded etcd TLS with client certificates and a root user.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.common.tokenizer import ByteTokenizer
from kvmesh.services.engine.model import LlamaModel
from kvmesh.services.launcher import LocalCluster, listening_ports
from tests.cluster_util import NODE_ARGS, generate, status

UP = [sys.executable, "-m", "kvmesh.services.cli", "up", "--port", "0", "--http-port", "-1"]
UP += ["--block-size", "16"]
READY = "Ctrl-C stops the cluster"


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper that is not ours counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still alive after up to ``timeout`` s (checked every 0.1 s)."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if _alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if _alive(p)]
    return left


def _wait_line(log: Path, needle: str, proc: subprocess.Popen, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if needle in text:
            return text
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{text}"
        time.sleep(0.2)
    pytest.fail(f"no {needle!r} in {timeout}s:\n{log.read_text(errors='replace')}")


def _kill_leftovers(pids: list[int]) -> None:
    """The test's own processes, should one survive a failing assertion."""
    for pid in pids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def test_sigkill_of_kvmesh_up_leaves_no_child_alive(tmp_path):
    log = tmp_path / "up.log"
    with open(log, "wb") as out:
        up = subprocess.Popen([*UP, "--workdir", str(tmp_path / "w")], stdout=out, stderr=out)
    children: list[int] = []
    try:
        _wait_line(log, READY, up)
        children = _children(up.pid)
        assert len(children) == 5  # etcd + store-master + conductor + prefill + decode
        up.kill()  # SIGKILL: no handler, no teardown
        up.wait(10)
        left = _wait_gone(children, 30)
        assert not left, f"children outlived kvmesh up: {left}"
        for name in ("store-master-0", "conductor-0", "prefill-0", "decode-0"):
            # no grace period, no drain: their launcher (and etcd with it) is gone
            text = (tmp_path / "w" / f"{name}.log").read_text(errors="replace")
            assert "the launcher is gone; exiting now" in text, text[-2000:]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        _kill_leftovers(children)


@pytest.fixture(scope="module")
def reference():
    model, tok = LlamaModel.from_preset("tiny", seed=0), ByteTokenizer()
    return lambda p, n=8: model.reference_generate(tok.encode(p), n, eos_id=tok.eos_id)


def _generate_retrying(conductor: str, prompt: str, timeout: float = 60):
    """A client's retry loop: UNAVAILABLE (the node is gone, not back yet) is retried."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return generate(conductor, prompt, max_tokens=8, timeout=30)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
        time.sleep(0.3)


def test_killed_node_is_restarted_and_serves_until_restarts_run_out(tmp_path, reference):
    said: list[str] = []
    c = LocalCluster(
        str(tmp_path),
        lease_ttl=3,
        node_args=NODE_ARGS,
        max_restarts=1,
        restart_backoff_s=0.2,
        log=said.append,
    )
    try:
        c.start()
        prompt = "Restarted nodes serve the same tokens."
        assert generate(c.conductor, prompt, max_tokens=8).tokens == reference(prompt)
        old = c.procs["decode-0"]
        os.kill(old.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while c.procs["decode-0"] is old and time.monotonic() < deadline:
            time.sleep(0.1)
        new = c.procs["decode-0"]
        assert new is not old and new.poll() is None, said
        assert any("decode-0 exited with -9; restarting" in m for m in said), said
        # it registered again: the conductor's view has the new process's port
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            nodes = status(c.conductor).nodes
            addr = next((n.grpc_address for n in nodes if n.node_id == "decode-0"), ":0")
            if int(addr.rsplit(":", 1)[1]) in (listening_ports(new.pid) or ()):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"decode-0 did not register its new address ({addr})")
        assert _generate_retrying(c.conductor, prompt).tokens == reference(prompt)
        assert not c.failure()

        etcd = c.etcd.proc  # etcd is supervised too: same ports, same data
        os.kill(etcd.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not any(m.startswith("restarted etcd") for m in said):
            assert time.monotonic() < deadline, said
            time.sleep(0.1)
        assert c.etcd.proc not in (etcd, None) and c.etcd.proc.poll() is None, said
        assert _generate_retrying(c.conductor, prompt + " Again.").tokens == reference(
            prompt + " Again."
        )
        assert not c.failure()

        os.kill(new.pid, signal.SIGKILL)  # a second death: max_restarts=1 has run out
        deadline = time.monotonic() + 30
        while not c.failure() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "decode-0" in c.failure() and "giving up" in c.failure()
        assert c.procs["decode-0"] is new  # not started a third time
    finally:
        c.stop()
    assert not [p.pid for p in c._children if _alive(p.pid)]
    assert not os.path.exists(os.path.join(str(tmp_path), "etcd"))


def test_background_sigint_stops_kvmesh_up_cleanly(tmp_path):
    """A script's background job starts with SIGINT ignored (bash without job control):
    ``kill -INT`` must still stop the cluster, every child and etcd's data with it."""
    # the premise: such a job starts with SIGINT ignored
    sig_ign = subprocess.run(
        ["bash", "-c", "grep SigIgn: /proc/self/status & wait"], capture_output=True, text=True
    ).stdout.split()[1]
    assert int(sig_ign, 16) & (1 << (signal.SIGINT - 1))
    log, work = tmp_path / "up.log", tmp_path / "w"
    cmd = " ".join([*UP, "--workdir", str(work)])
    sh = subprocess.Popen(
        ["bash", "-c", f"{cmd} >{log} 2>&1 & echo $!; wait $!"],
        stdout=subprocess.PIPE,
        text=True,
    )
    children: list[int] = []
    try:
        up_pid = int(sh.stdout.readline())
        _wait_line(log, READY, sh)
        children = _children(up_pid)
        assert len(children) == 5
        os.kill(up_pid, signal.SIGINT)
        assert sh.wait(60) == 0, log.read_text()
        assert "stopping the cluster" in log.read_text()
        assert not _wait_gone(children, 5)  # reaped by kvmesh up before it exited
        assert not (work / "etcd").exists()  # etcd's data dir went with it
    finally:
        if sh.poll() is None:
            sh.kill()
            sh.wait()
        _kill_leftovers(children)


def test_second_signal_during_teardown_still_leaves_nothing(tmp_path):
    """SIGTERM to ``kvmesh up``'s process group, then another while it stops the
    cluster: every child is reaped and etcd's data dir removed all the same."""
    log, work = tmp_path / "up.log", tmp_path / "w"
    with open(log, "wb") as out:
        up = subprocess.Popen(
            [*UP, "--workdir", str(work)], stdout=out, stderr=out, start_new_session=True
        )
    children: list[int] = []
    try:
        _wait_line(log, READY, up)
        children = _children(up.pid)
        assert len(children) == 5
        os.killpg(up.pid, signal.SIGTERM)
        _wait_line(log, "stopping the cluster", up, 30)
        os.killpg(up.pid, signal.SIGTERM)
        assert up.wait(60) == 0, log.read_text()
        assert not _wait_gone(children, 5), log.read_text()
        assert not (work / "etcd").exists()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        _kill_leftovers(children)


def test_tls_cluster_etcd_has_tls_and_a_user(tmp_path):
    from kvmesh.services.common.channels import channel_credentials
    from kvmesh.services.common.etcd import EtcdClient, EtcdError, etcd_credentials

    c = LocalCluster(str(tmp_path), node_args=NODE_ARGS, tls=True, http_port=-1)
    try:
        c.start()
        with grpc.secure_channel(c.conductor, channel_credentials(c.client_tls())) as ch:
            last = None
            for r in pbg.ConductorStub(ch).Generate(
                pb.GenerateRequest(prompt="over TLS", max_tokens=3), timeout=30
            ):
                last = r
        assert last.finish_reason and last.usage.completion_tokens == 3

        ident = c.client_tls()
        creds = etcd_credentials(ident.ca, ident.cert, ident.key)

        async def probe():
            results = {}
            for what, kw in (
                ("plaintext", {}),
                ("certificate, no password", {"credentials": creds}),
                ("certificate and password", {"credentials": creds, **_root(c)}),
            ):
                client = EtcdClient(c.etcd_endpoint, timeout=3, **kw)
                try:
                    results[what] = await client.get_prefix("/kvmesh/")
                except EtcdError as e:
                    results[what] = e
                finally:
                    await client.close()
            return results

        got = asyncio.run(probe())
        assert isinstance(got["plaintext"], EtcdError), got
        assert isinstance(got["certificate, no password"], EtcdError), got
        keys = [k for k, _ in got["certificate and password"][0]]
        assert any("/nodes/decode/decode-0" in k for k in keys), keys
        pw = (tmp_path / "etcd-password").read_text().strip()
        assert pw == c.etcd_password and len(pw) >= 32
        assert oct((tmp_path / "etcd-password").stat().st_mode & 0o777) == "0o600"
    finally:
        c.stop()


def _root(c: LocalCluster) -> dict:
    return {"user": c.etcd_user, "password": c.etcd_password}


SLEEPER = "import signal, sys, time; {}; print('ready', flush=True); time.sleep(60)"


def _sleeper(track: list, ignore_term: bool = False) -> subprocess.Popen:
    from kvmesh.services.children import spawn_tied

    setup = "signal.signal(signal.SIGTERM, signal.SIG_IGN)" if ignore_term else "pass"
    p = spawn_tied(
        [sys.executable, "-c", SLEEPER.format(setup)], track, stdout=subprocess.PIPE, text=True
    )
    assert p.stdout.readline().strip() == "ready"  # its handlers are in place
    return p


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace():
    from kvmesh.services.children import terminate_all

    track: list[subprocess.Popen] = []
    stubborn, polite = _sleeper(track, ignore_term=True), _sleeper(track)
    try:
        terminate_all(track, grace=0.5)
        assert polite.returncode == -signal.SIGTERM
        assert stubborn.returncode == -signal.SIGKILL
    finally:
        for p in track:
            if p.poll() is None:
                p.kill()
                p.wait()


ECHO = """
import os, signal, sys
def term(*_):
    os.write(1, b"term\\n")
    os._exit(0)
signal.signal(signal.SIGTERM, term)
print("ready", flush=True)
for line in sys.stdin:
    print("alive", flush=True)
"""


def test_a_child_started_from_a_short_lived_thread_outlives_the_thread():
    """Linux sends the parent-death signal when the *thread* that forked the child ends:
    children are forked by one long-lived thread whatever thread asks for them. The
    child answers "term" from a SIGTERM handler; asked after the thread is gone from the
    kernel (the signal, were it sent, is then pending), it must answer "alive"."""
    import threading

    from kvmesh.services.children import spawn_tied

    track: list[subprocess.Popen] = []

    def start() -> None:
        p = spawn_tied(
            [sys.executable, "-c", ECHO],
            track,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert p.stdout.readline().strip() == "ready"  # its handler is in place

    t = threading.Thread(target=start)
    t.start()
    try:
        t.join(30)
        assert not t.is_alive() and len(track) == 1
        # join() returns before the OS thread has exited: wait until the kernel has
        # released it (PDEATHSIG is sent during that exit, before the task goes)
        task = Path(f"/proc/self/task/{t.native_id}")
        deadline = time.monotonic() + 30
        while task.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not task.exists()
        child = track[0]
        child.stdin.write("ping\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "alive"
        assert child.poll() is None
    finally:
        for p in track:
            p.kill()
            p.wait()


def test_stop_also_stops_a_process_put_in_procs_by_hand(tmp_path):
    """The netns fault puts a node started through ``ip netns exec`` in ``procs``."""
    c = LocalCluster(str(tmp_path))
    c.procs["by-hand"] = p = subprocess.Popen(
        [sys.executable, "-c", SLEEPER.format("pass")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout.readline().strip() == "ready"
        c.stop(grace=5)
        assert p.returncode == -signal.SIGTERM
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_spawn_tied_runs_no_python_between_fork_and_exec(monkeypatch):
    """``preexec_fn`` is unsafe in a process with threads (the child can deadlock on a lock
    held at the fork): the parent-death signal is set by an exec wrapper instead."""
    from kvmesh.services import children

    seen: list[dict] = []
    real = subprocess.Popen

    def recording(argv, **kw):
        seen.append(kw)
        return real(argv, **kw)

    monkeypatch.setattr(subprocess, "Popen", recording)
    track: list[subprocess.Popen] = []
    try:
        p = children.spawn_tied([sys.executable, "-c", "pass"], track)
        assert p.wait(30) == 0
    finally:
        for p in track:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert len(seen) == 1 and seen[0].get("preexec_fn") is None, seen


VIAS = ["setpriv", "python"]


@pytest.mark.parametrize("via", VIAS)
def test_the_wrapper_runs_the_command_itself_only_under_the_expected_parent(via):
    from kvmesh.services.children import tied_argv

    if via == "setpriv" and shutil.which("setpriv") is None:
        pytest.skip("util-linux setpriv is not installed")
    cmd = [sys.executable, "-c", "import os; print(os.getpid(), flush=True)"]
    ok = subprocess.run(
        tied_argv(cmd, os.getpid(), signal.SIGTERM, via), capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    wrong = subprocess.run(tied_argv(cmd, 1, signal.SIGTERM, via), capture_output=True, text=True)
    assert wrong.returncode == 1 and wrong.stdout == "", (wrong.stdout, wrong.stderr)
    # the pid Popen returns is the command's own: exec, not a child of the wrapper
    p = subprocess.Popen(
        tied_argv(cmd, os.getpid(), signal.SIGTERM, via), stdout=subprocess.PIPE, text=True
    )
    out, _ = p.communicate(timeout=30)
    assert int(out) == p.pid


def test_a_missing_program_still_raises_file_not_found():
    from kvmesh.services.children import spawn_tied

    track: list[subprocess.Popen] = []
    with pytest.raises(FileNotFoundError):
        spawn_tied(["kvmesh-no-such-program-anywhere"], track)
    assert track == []


MIDDLE = """
import subprocess, sys
from kvmesh.services.children import spawn_tied
p = spawn_tied([sys.executable, "-c", sys.argv[2]], [], via=sys.argv[1])
print(p.pid, flush=True)
sys.stdin.read()
"""
ANNOUNCER = """
import os, signal, sys, time
def term(*_):
    os.write(2, b"term\\n")
    os._exit(0)
signal.signal(signal.SIGTERM, term)
os.write(2, b"ready\\n")
time.sleep(60)
"""


@pytest.mark.parametrize("via", VIAS)
def test_a_tied_child_gets_sigterm_when_its_parent_is_sigkilled(tmp_path, via):
    if via == "setpriv" and shutil.which("setpriv") is None:
        pytest.skip("util-linux setpriv is not installed")
    out = tmp_path / "child.out"
    with open(out, "wb") as f:
        # the child inherits f as its stderr through the middle process
        middle = subprocess.Popen(
            [sys.executable, "-c", MIDDLE, via, ANNOUNCER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=f,
        )
    child = 0
    try:
        child = int(middle.stdout.readline())
        deadline = time.monotonic() + 30
        while b"ready" not in out.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b"ready" in out.read_bytes(), out.read_bytes()
        middle.kill()
        middle.wait(10)
        assert not _wait_gone([child], 30)
        assert out.read_bytes().split() == [b"ready", b"term"]
    finally:
        if middle.poll() is None:
            middle.kill()
            middle.wait()
        if child:
            _kill_leftovers([child])


def test_a_setpriv_without_pdeathsig_falls_back_to_the_python_shim(tmp_path, monkeypatch):
    """util-linux before 2.33 has a setpriv that does not know --pdeathsig: using it
    would make every child exit at once, so the python shim ties them instead."""
    from kvmesh.services import children

    old = tmp_path / "setpriv"
    old.write_text("#!/bin/sh\necho 'Usage: setpriv [options] <program>'\n")
    old.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    children._setpriv_with_pdeathsig.cache_clear()
    try:
        argv = children.tied_argv(["true"], os.getpid(), signal.SIGTERM)
        assert argv[0] == sys.executable and "prctl" in argv[4], argv
        with pytest.raises(FileNotFoundError, match="2.33"):
            children.tied_argv(["true"], os.getpid(), signal.SIGTERM, via="setpriv")
    finally:
        children._setpriv_with_pdeathsig.cache_clear()


def test_nodes_share_the_cores_only_where_nothing_sets_threads(tmp_path):
    """Review of the core sharing: a launcher hands its nodes a share of the machine's
    cores as a hint below every way of setting ``threads``: a flag, ``KVMESH_THREADS`` or
    a config file (all of which set the option) win over it."""
    from kvmesh.services.common.config import load
    from kvmesh.services.common.settings import THREAD_SHARE_ENV
    from kvmesh.services.launcher.cluster import LocalCluster, node_threads
    from kvmesh.services.model_node import torch_threads
    from kvmesh.services.node_config import NodeConfig

    c = LocalCluster(str(tmp_path), prefill=1, decode=1, node_args=["--threads=3"])
    env = c.env()
    assert env[THREAD_SHARE_ENV] == str(node_threads(2))
    assert "--threads=3" in c.node_args and c.node_args.count("--threads") == 0  # untouched
    assert torch_threads(0, env) == node_threads(2)  # nothing set threads: the share
    assert torch_threads(3, env) == 3  # a flag, KVMESH_THREADS or a config file: theirs
    assert torch_threads(0, {}) == 0  # no launcher: torch's default
    assert torch_threads(0, {**env, "OMP_NUM_THREADS": "1"}) == 0  # torch reads that one
    assert torch_threads(0, {THREAD_SHARE_ENV: "two"}) == 0  # not a number: ignored
    cfg = load(NodeConfig, [], env={"KVMESH_THREADS": "5", **env})
    assert torch_threads(cfg.threads, env) == 5
