"""The systemd units' health check works on a TLS deployment (issue 18, item 4).

Each unit runs ``ExecStartPost=kvmesh health --wait 280 ...`` in the service's own
environment (``/etc/kvmesh/kvmesh.env``). When that file turns TLS on with
``KVMESH_TLS_*``, the CLI must read the same variables as the service, or the check
fails and systemd restarts the unit forever. Here a real store-master serves mutual TLS,
configured only through the environment, and each unit's health command line runs
against it as systemd would run it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvmesh.services.common.pki import DevCA
from tests.etcd_server import etcd_server, leader_port
from tests.test_deploy import BINARY, UNITS, exec_argv, parse_unit, unit_environment, values

pytestmark = pytest.mark.timeout(300)


def _bare_env() -> dict[str, str]:
    """This process's environment without any KVMESH_* (never the developer's)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}


@pytest.fixture(scope="module")
def tls_service(tmp_path_factory) -> Iterator[tuple[int, dict[str, str]]]:
    """A real store-master on a known port, with mutual TLS from KVMESH_TLS_* only;
    yields its port and those variables."""
    ident = DevCA(str(tmp_path_factory.mktemp("pki"))).issue("store-master")
    tls = {"KVMESH_TLS_CERT": ident.cert, "KVMESH_TLS_KEY": ident.key, "KVMESH_TLS_CA": ident.ca}
    with etcd_server() as etcd:
        env = {**_bare_env(), **tls, "KVMESH_ETCD": etcd.endpoint, "KVMESH_HOST": "127.0.0.1"}
        # port 0, then the port it bound read from etcd: a port picked here could be
        # taken by another process before the store-master binds it
        p = subprocess.Popen(
            [sys.executable, "-m", "kvmesh.services.cli", "store-master", "--port", "0"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            yield leader_port(etcd.endpoint, "store-master", p), tls
        finally:
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _health_argv(path, port: int, extra_env: dict[str, str]) -> tuple[list[str], dict]:
    """The unit's ExecStartPost health command as systemd runs it, with kvmesh.env
    pointing the unit at ``port`` on loopback plus ``extra_env``; and that environment."""
    unit = parse_unit(path)
    posts = [v for v in values(unit, "Service", "ExecStartPost") if " health " in v]
    assert len(posts) == 1, f"{path.name}: want one ExecStartPost=kvmesh health"
    env = unit_environment(unit)
    role = path.name.removeprefix("kvmesh-").removesuffix(".service")
    env.update(
        {"KVMESH_HOST": "127.0.0.1", f"KVMESH_{role.upper().replace('-', '_')}_PORT": str(port)}
    )
    env.update(extra_env)
    argv = exec_argv(posts[0], env)
    assert argv[0] == BINARY and argv[1] == "health", argv
    assert not any(a.startswith("--tls") for a in argv), "the unit passes no TLS flags"
    return [sys.executable, "-m", "kvmesh.services.cli", *argv[1:]], {**_bare_env(), **env}


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_unit_health_check_passes_on_a_tls_service_configured_by_environment(tls_service, path):
    port, tls = tls_service
    argv, env = _health_argv(path, port, tls)
    assert "--wait" in argv and "280" in argv, argv  # the unit's command, unchanged
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=290)
    assert out.returncode == 0, out.stdout + out.stderr


def test_without_the_tls_environment_the_check_fails(tls_service):
    """The check above proves something only if the TLS variables are what make it pass."""
    port, tls = tls_service
    ok_argv, ok_env = _health_argv(UNITS[0], port, tls)
    # the service is up (same check, with the environment)
    assert subprocess.run(ok_argv, env=ok_env, capture_output=True, timeout=290).returncode == 0
    argv, env = _health_argv(UNITS[0], port, {})
    argv[argv.index("--wait") + 1] = "1"  # it would retry for 280 s
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0, out.stdout + out.stderr
