"""Deployment files stay in step with the code: every command line in the systemd units and
in docker-compose.yml parses with the real config class of its role, and the compose file
is valid for docker-compose and for the compose specification's schema.

Fast and hermetic: the config loader runs in-process with an explicit environment (never
this machine's), and the external tools are skipped where they are not installed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvmesh.services.common.config import ConfigError, load
from kvmesh.services.conductor.config import ConductorConfig
from kvmesh.services.decode.server import DecodeConfig
from kvmesh.services.prefill.server import PrefillConfig
from kvmesh.services.store_master.config import StoreMasterConfig

ROOT = Path(__file__).resolve().parent.parent
SYSTEMD = ROOT / "deploy" / "systemd"
ENV_EXAMPLE = SYSTEMD / "kvmesh.env.example"
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
BINARY = "/usr/local/bin/kvmesh"
# What an operator generates (`openssl rand -hex 32`) and sets: the deploy files ship none.
OPERATOR_SECRET = "5f2b" * 16

ROLES = {
    "conductor": ConductorConfig,
    "store-master": StoreMasterConfig,
    "prefill": PrefillConfig,
    "decode": DecodeConfig,
}
UNITS = sorted(SYSTEMD.glob("*.service"))


# --------------------------------------------------------------------------- helpers


def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit as {section: [(key, value), ...]}, continuation lines joined."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            sections.setdefault(current, [])
            continue
        assert current is not None, f"{path.name}: {line!r} outside a section"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: {line!r} is not key=value"
        sections[current].append((key.strip(), value.strip()))
    assert not pending, f"{path.name}: file ends inside a continued line"
    return sections


def values(unit: dict, section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def parse_env_file(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: {line!r} is not KEY=VALUE"
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def unit_environment(unit: dict, secret: str | None = OPERATOR_SECRET) -> dict[str, str]:
    """What the service sees: Environment= first, then EnvironmentFile= (which overrides);
    /etc/kvmesh/kvmesh.env is played by kvmesh.env.example with the operator's ``secret``
    filled in (None: the example as shipped), optional ('-') files are absent."""
    env: dict[str, str] = {}
    for assignment in values(unit, "Service", "Environment"):
        for word in shlex.split(assignment):
            key, _, value = word.partition("=")
            env[key] = value
    files = values(unit, "Service", "EnvironmentFile")
    assert "/etc/kvmesh/kvmesh.env" in files, "units must read /etc/kvmesh/kvmesh.env"
    for f in files:
        if f == "/etc/kvmesh/kvmesh.env":
            env.update(parse_env_file(ENV_EXAMPLE))
            if secret is not None:
                env["KVMESH_SECRET"] = secret
        else:
            assert f.startswith("-"), f"EnvironmentFile={f}: only kvmesh.env may be required"
    return env


_SPECIFIERS = {
    "%H": "node1.example",
    "%l": "node1",
    "%n": "unit.service",
    "%N": "unit",
    "%S": "/var/lib",
    "%C": "/var/cache",
    "%L": "/var/log",
    "%t": "/run",
    "%%": "%",
}


def exec_argv(line: str, env: dict[str, str]) -> list[str]:
    """ExecStart= as systemd runs it: specifiers, then ${VAR} (one word) and $VAR (split)."""
    line = line.lstrip("-@:+!")
    line = re.sub(r"%.", lambda m: _SPECIFIERS.get(m.group(0), m.group(0)), line)

    def var(name: str) -> str:
        assert name in env, (
            f"ExecStart uses ${name}, which neither the unit nor kvmesh.env.example sets"
        )
        return env[name]

    argv: list[str] = []
    for word in shlex.split(line):
        whole = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if whole:
            argv.extend(var(whole.group(1)).split())
            continue
        argv.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: var(m.group(1)), word))
    return argv


_COMPOSE_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?([-?])([^}]*))?\}|\$\$")


class ComposeVariableMissing(Exception):
    """A ${VAR:?message} whose VAR is unset: docker-compose refuses with the message."""


def compose_interpolate(value, host_env: dict[str, str]):
    """docker-compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error} and $$ over
    a whole tree."""
    if isinstance(value, dict):
        return {k: compose_interpolate(v, host_env) for k, v in value.items()}
    if isinstance(value, list):
        return [compose_interpolate(v, host_env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, kind, text = m.group(1), m.group(2), m.group(3)
        if host_env.get(name):
            return host_env[name]
        if kind == "?":
            raise ComposeVariableMissing(f"{name}: {text}")
        assert kind == "-", f"${{{name}}} has no default in docker-compose.yml"
        return text

    return _COMPOSE_VAR.sub(sub, value)


def compose_services(host_env: dict[str, str] | None = None) -> dict[str, dict]:
    """The services of docker-compose.yml as compose sees them with ``host_env`` (default:
    only the operator's KVMESH_SECRET set, which the file requires)."""
    env = {"KVMESH_SECRET": OPERATOR_SECRET} if host_env is None else host_env
    data = compose_interpolate(yaml.safe_load(COMPOSE.read_text()), host_env=env)
    return data["services"]


def kvmesh_services() -> list[tuple[str, dict]]:
    return [(name, svc) for name, svc in compose_services().items() if name != "etcd"]


def flag(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


# --------------------------------------------------------------------------- systemd


def test_there_is_one_unit_per_role():
    assert sorted(p.name for p in UNITS) == sorted(f"kvmesh-{r}.service" for r in ROLES)


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_unit_exec_start_parses_with_the_role_config(path: Path):
    unit = parse_unit(path)
    starts = values(unit, "Service", "ExecStart")
    assert len(starts) == 1, f"{path.name}: want exactly one ExecStart"
    env = unit_environment(unit)
    argv = exec_argv(starts[0], env)
    assert argv[0] == BINARY
    role = argv[1]
    assert role in ROLES, f"{path.name}: {role!r} is not one of {sorted(ROLES)}"
    assert path.name == f"kvmesh-{role}.service"
    cls = ROLES[role]
    cfg = load(cls, argv[2:], prog=f"kvmesh {role}", section=role, env=env)
    assert isinstance(cfg, cls)
    # The flags and the environment file really reached the config.
    example = parse_env_file(ENV_EXAMPLE)
    assert cfg.cluster == example["KVMESH_CLUSTER"]
    assert cfg.etcd == example["KVMESH_ETCD"]
    assert cfg.host == example["KVMESH_HOST"]
    assert cfg.port == int(flag(argv, "--port"))
    assert cfg.port != 0, "a unit must pin its gRPC port"
    if hasattr(cfg, "secret"):
        assert cfg.secret == OPERATOR_SECRET
        assert "--secret" not in argv, "the secret must not be on the command line"
        assert cfg.data_port != 0, "a node unit must pin its data-plane port"

    # A wrong flag or a wrong value must fail, or this test proves nothing.
    with pytest.raises(SystemExit):
        load(cls, argv[2:] + ["--no-such-flag", "1"], env=env)
    with pytest.raises(ConfigError):
        load(cls, argv[2:] + ["--port", "not-a-port"], env=env)


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_unit_service_settings(path: Path):
    unit = parse_unit(path)
    svc = dict(unit["Service"])
    assert svc["Type"] == "simple"
    assert svc["User"] == "kvmesh"
    assert svc["Restart"] == "on-failure"
    assert svc["KillSignal"] == "SIGTERM"
    assert int(svc["TimeoutStopSec"]) > 0
    for key, want in [
        ("NoNewPrivileges", "true"),
        ("ProtectSystem", "strict"),
        ("PrivateTmp", "true"),
    ]:
        assert svc.get(key) == want, f"{path.name}: {key}={want} expected"
    after = " ".join(values(unit, "Unit", "After")).split()
    wants = " ".join(values(unit, "Unit", "Wants")).split()
    for dep in ("network-online.target", "etcd.service"):
        assert dep in after and dep in wants, f"{path.name}: After/Wants {dep}"


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_unit_nodes_refuse_to_start_without_a_secret(path: Path):
    """kvmesh.env.example ships no working secret: until the operator sets one, a node
    refuses to start, telling to set KVMESH_SECRET; so it does with a well-known one."""
    unit = parse_unit(path)
    argv = exec_argv(values(unit, "Service", "ExecStart")[0], unit_environment(unit))
    role, cls = argv[1], ROLES[argv[1]]
    for secret in (None, "change-me", "kvmesh-dev-secret"):
        env = unit_environment(unit, secret)
        if "secret" not in cls.__dataclass_fields__:  # conductor, store-master
            load(cls, argv[2:], section=role, env=env)
            continue
        with pytest.raises(ConfigError, match="KVMESH_SECRET"):
            load(cls, argv[2:], section=role, env=env)


def test_compose_requires_a_secret():
    """docker-compose.yml ships no working secret: compose refuses to start without one,
    and a node given a well-known one refuses to start on its (non-loopback) address."""
    with pytest.raises(ComposeVariableMissing, match="KVMESH_SECRET"):
        compose_services(host_env={})
    svc = compose_services(host_env={"KVMESH_SECRET": "change-me"})["decode"]
    env = {k: str(v) for k, v in svc["environment"].items()}
    with pytest.raises(ConfigError, match="KVMESH_SECRET"):
        load(DecodeConfig, [str(a) for a in svc["command"][1:]], section="decode", env=env)


def test_env_example_only_sets_known_names():
    """A typo (KVMESH_KV_MEMROY) in the example would be silently ignored by the loader."""
    fields = {
        f"KVMESH_{name.upper()}" for cls in ROLES.values() for name in cls.__dataclass_fields__
    }
    used_by_units = set()
    for path in UNITS:
        used_by_units |= set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", path.read_text()))
    unknown = set(parse_env_file(ENV_EXAMPLE)) - fields - used_by_units
    assert not unknown, f"kvmesh.env.example sets names no service reads: {sorted(unknown)}"


def test_systemd_analyze_verify():
    exe = shutil.which("systemd-analyze")
    if not exe:
        pytest.skip("systemd-analyze is not installed")
    for path in UNITS:
        r = subprocess.run([exe, "verify", str(path)], capture_output=True, text=True, timeout=30)
        # The kvmesh binary is not installed where the tests run; anything else is a fault.
        problems = [l for l in (r.stdout + r.stderr).splitlines() if l.strip() and BINARY not in l]
        assert not problems, f"{path.name}:\n" + "\n".join(problems)


# --------------------------------------------------------------------------- compose


def test_compose_has_every_role_once():
    roles = sorted(svc["command"][0] for _, svc in kvmesh_services())
    assert roles == sorted(ROLES)


@pytest.mark.parametrize("name", [n for n, _ in kvmesh_services()])
def test_compose_command_parses_with_the_role_config(name: str):
    svc = compose_services()[name]
    command = svc["command"]
    assert isinstance(command, list), f"{name}: give command as a list (exec form)"
    role, argv = command[0], [str(a) for a in command[1:]]
    assert role in ROLES, f"{name}: {role!r} is not one of {sorted(ROLES)}"
    env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
    cls = ROLES[role]
    cfg = load(cls, argv, prog=f"kvmesh {role}", section=role, env=env)
    assert cfg.etcd == "etcd:2379"
    assert cfg.host == name, f"{name}: must advertise its own service name as --host"
    assert cfg.port != 0
    if hasattr(cfg, "secret"):
        assert cfg.secret == env["KVMESH_SECRET"] == OPERATOR_SECRET
    with pytest.raises(SystemExit):
        load(cls, argv + ["--no-such-flag", "1"], env=env)

    # Image, health, order and shutdown.
    assert svc["build"]["dockerfile"] == "deploy/Dockerfile"
    # the control plane runs the torch-free image, the model nodes the engine's
    want = "node" if role in ("prefill", "decode") else "control"
    assert svc["build"]["target"] == want, f"{name}: build target {want!r}"
    test = svc["healthcheck"]["test"]
    assert test == ["CMD", "kvmesh", "health", f"{name}:{cfg.port}"]
    assert cfg.metrics_port > 0, f"{name}: pin the metrics port so Prometheus can scrape it"
    assert svc["depends_on"]["etcd"]["condition"] == "service_healthy"
    assert svc.get("restart") and svc.get("stop_grace_period")
    if role == "conductor":
        assert cfg.port == 50051
        assert any(str(p).endswith(":50051") for p in svc["ports"])
        assert cfg.http_port == 8000
        assert any(str(p).endswith(":8000") for p in svc["ports"])


def test_compose_etcd():
    etcd = compose_services()["etcd"]
    assert etcd["image"] == "quay.io/coreos/etcd:v3.4.27"
    assert "endpoint" in etcd["healthcheck"]["test"] and "health" in etcd["healthcheck"]["test"]


def test_compose_file_is_valid_for_docker_compose(tmp_path: Path):
    exe = shutil.which("docker-compose")
    if not exe:
        pytest.skip("the docker-compose binary is not installed")
    r = subprocess.run(
        [exe, "-f", str(COMPOSE), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "KVMESH_SECRET": OPERATOR_SECRET},
    )
    assert r.returncode == 0, r.stderr


def test_compose_file_matches_the_compose_spec():
    exe = shutil.which("check-jsonschema")
    if not exe:
        pytest.skip("check-jsonschema is not installed")
    r = subprocess.run(
        [exe, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


# --------------------------------------------------------------------------- Dockerfile


def test_dockerfile():
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    assert "torch==2.13.0" in text
    assert re.search(r'^ENTRYPOINT \["kvmesh"\]', text, re.M)
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0"), "the image must run as a non-root user"
    stages = dict(re.findall(r"^FROM \S+ AS (\w+)\n(.*?)(?=^FROM |\Z)", text, re.M | re.S))
    assert {"control", "node"} <= set(stages)
    # the conductor's and store-master's image installs no engine: no torch at all
    assert "torch" not in stages["control"] and "[engine]" not in stages["control"]
    assert "torch==2.13.0" in stages["node"] and "'.[engine]'" in stages["node"]
    for stage in ("control", "node"):
        users = re.findall(r"^USER\s+(\S+)", stages[stage], re.M)
        assert users and users[-1] not in ("root", "0"), f"{stage}: run as a non-root user"
