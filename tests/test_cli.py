"""`kvmesh up` runs a whole cluster as real processes and stops all of it on SIGTERM;
`kvmesh generate` and `kvmesh status` talk to it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

from kvmesh.services.engine.checkpoint import load_model


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.services.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def test_up_generate_status_and_clean_stop(tmp_path):
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvmesh.services.cli",
            "up",
            "--port",
            "0",  # a port picked free here could be taken before the conductor binds it
            "--block-size",
            "16",
            "--workdir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            assert line, "kvmesh up exited early:\n" + "".join(lines)
            lines.append(line)
            if "Ctrl-C stops the cluster" in line:
                break
        text = "".join(lines)
        bound = re.search(r"conductor at 127\.0\.0\.1:(\d+)", text)
        assert bound and int(bound.group(1)) > 0, text
        port = int(bound.group(1))
        children = _children(up.pid)
        assert len(children) == 5  # etcd + four services

        conductor = f"127.0.0.1:{port}"
        gen = _cli(
            "generate", "Hello from the CLI", "--conductor", conductor, "--max-tokens", "6", "-v"
        )
        assert gen.returncode == 0, gen.stderr
        assert "completion=6" in gen.stderr
        st = _cli("status", "--conductor", conductor, "--json")
        assert st.returncode == 0, st.stderr
        roles = sorted(n["role"] for n in json.loads(st.stdout)["nodes"])
        assert roles == ["conductor", "decode", "prefill", "store-master"]
        bad = _cli("generate", "", "--conductor", conductor)
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr

        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
        for pid in children:
            assert (
                not os.path.exists(f"/proc/{pid}")
                or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
            ), f"child {pid} still runs"
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_generate_output_is_the_reference_text(tmp_path):
    """`kvmesh up --demo` serves one prompt with the shipped `demo` model (its default) and
    stops; its tokens are the reference's, English words. The conductor binds any free
    port (--port 0) and the launcher reads it from etcd."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh.services.cli",
            "up",
            "--port",
            "0",
            "--block-size",
            "16",
            "--demo",
            "Hello, kvmesh",
            "--max-tokens",
            "12",
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    bound = re.search(r"conductor at 127\.0\.0\.1:(\d+)", out.stdout)
    assert bound and int(bound.group(1)) > 0, out.stdout
    lm = load_model("demo")
    tok = lm.tokenizer
    ref = lm.model.reference_generate(tok.encode("Hello, kvmesh"), 12, tok.eos_id)
    text = tok.decode(ref)
    assert text in out.stdout
    assert f"completion={len(ref)}" in out.stderr
    assert {"the", "and", "of"} & set(re.findall(r"[a-z]+", text)), text  # it speaks


def _cli_without_torch(*args: str) -> subprocess.CompletedProcess:
    """The CLI in a process where torch cannot be imported (the base install)."""
    code = (
        "import sys; sys.modules['torch'] = None; "
        "from kvmesh.services.cli import main; main(sys.argv[1:])"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
    )


def test_without_the_engine_nodes_say_how_to_install_it():
    """A base install (no torch) runs the conductor and the store-master; a model node or
    ``kvmesh up`` says what to install instead of a traceback."""
    for role in ("prefill", "decode"):
        r = _cli_without_torch(role, "--model", "tiny")
        assert r.returncode != 0
        assert "pip install 'kvmesh[engine]'" in r.stderr and "Traceback" not in r.stderr
    r = _cli_without_torch("up")
    assert r.returncode != 0 and "pip install 'kvmesh[engine]'" in r.stderr
    for role in ("conductor", "store-master"):
        r = _cli_without_torch(role, "--help")
        assert r.returncode == 0, r.stderr
        assert "--etcd" in r.stdout


def test_local_cluster_secret_is_random_or_the_operators_and_written_for_hand_started_nodes(
    tmp_path, monkeypatch
):
    import stat

    from kvmesh.services.common.settings import DEV_SECRET
    from kvmesh.services.launcher import cluster_secret

    monkeypatch.delenv("KVMESH_SECRET", raising=False)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = cluster_secret(str(tmp_path / "a")), cluster_secret(str(tmp_path / "b"))
    assert len(a) == 64 and a != b  # random, one per cluster
    path = tmp_path / "a" / "secret"
    assert path.read_text().strip() == a
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    monkeypatch.setenv("KVMESH_SECRET", "the-operators-own")
    assert cluster_secret(str(tmp_path / "b")) == "the-operators-own"
    monkeypatch.setenv("KVMESH_SECRET", DEV_SECRET)  # a well-known one is never used
    assert cluster_secret(str(tmp_path / "b")) not in (DEV_SECRET, "the-operators-own")


def test_a_service_ends_like_a_normal_exit_without_the_interpreter_teardown(tmp_path):
    """After its graceful shutdown a service process ends with os._exit (cli's
    _exit_after_shutdown): what a normal exit begins with still runs first - an idle
    thread-pool worker is told to end (no hang joining it), a non-daemon thread finishes
    its work, atexit handlers run, buffered logs and stdout are flushed - and the exit
    status is 0."""
    out = tmp_path / "thread.txt"
    code = f"""
import logging, sys, threading, time, atexit
from concurrent.futures import ThreadPoolExecutor
from kvmesh.services.cli import _exit_after_shutdown
pool = ThreadPoolExecutor(1)
pool.submit(lambda: None).result()  # its worker now idles, not a daemon
def late():
    time.sleep(0.5)
    open({str(out)!r}, "w").write("finished")
threading.Thread(target=late).start()
atexit.register(lambda: print("atexit ran"))
logging.basicConfig(stream=sys.stderr, level="INFO")
logging.getLogger("x").info("logged")
sys.stdout = open(sys.stdout.fileno(), "w", buffering=1 << 16, closefd=False)
print("in a big buffer")
_exit_after_shutdown()
print("never")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert out.read_text() == "finished"
    assert "atexit ran" in r.stdout and "in a big buffer" in r.stdout, r.stdout
    assert "never" not in r.stdout
    assert "logged" in r.stderr
