"""Bad values on the command line of the client commands are argparse errors naming
the option and its range (exit 2), never a traceback from building the request
(issue 18, item 9: ``kvmesh generate --seed -1``)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

BAD = [
    (["generate", "hi", "--seed", "-1"], "--seed", "0 to 18446744073709551615"),
    (["generate", "hi", "--seed", str(2**64)], "--seed", "0 to 18446744073709551615"),
    (["generate", "hi", "--seed", "one"], "--seed", "not an integer"),
    (["generate", "hi", "--max-tokens", "0"], "--max-tokens", "1 to 2147483647"),
    (["generate", "hi", "--max-tokens", str(2**31)], "--max-tokens", "1 to 2147483647"),
    (["generate", "hi", "--temperature", "-0.5"], "--temperature", ">= 0"),
    (["generate", "hi", "--temperature", "nan"], "--temperature", ">= 0"),
    (["generate", "hi", "--ttft-slo-ms", "-0.3"], "--ttft-slo-ms", ">= 0"),
    (["generate", "hi", "--timeout", "0"], "--timeout", "> 0"),
    (["status", "--watch", "--interval", "-1"], "--interval", "> 0"),
]


@pytest.mark.parametrize(("args", "option", "hint"), BAD, ids=[" ".join(a) for a, _, _ in BAD])
def test_bad_client_arguments_are_usage_errors(args, option, hint):
    # a conductor address where nothing listens: the command must stop before any call.
    # The port is bound (not listening: connections are refused) and held here, so no
    # other process can take it and answer meanwhile.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        argv = [*args, "--conductor", f"127.0.0.1:{held.getsockname()[1]}"]
        out = subprocess.run(
            [sys.executable, "-m", "kvmesh.services.cli", *argv],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert f"argument {option}:" in out.stderr and hint in out.stderr, out.stderr


BAD_CONDUCTORS = [
    (",", "no conductor address"),
    ("", "no conductor address"),
    (" , ,", "no conductor address"),
    ("127.0.0.1", "has no port"),
    ("127.0.0.1:99999", "1..65535"),  # grpc would dial port 99999 % 65536
    ("127.0.0.1:x", "1..65535"),
    (":50051", "has no host"),
    ("a b:1", "contains a space"),
    ("127.0.0.1:1,host-without-port", "'host-without-port' has no port"),
]


# every bad list for generate; one empty and one malformed list for status
CONDUCTOR_CASES = [("generate", c, h) for c, h in BAD_CONDUCTORS] + [
    ("status", c, h) for c, h in BAD_CONDUCTORS if c in (",", "127.0.0.1:99999")
]


@pytest.mark.parametrize(
    ("cmd", "conductor", "hint"), CONDUCTOR_CASES, ids=[f"{a} {c!r}" for a, c, _ in CONDUCTOR_CASES]
)
def test_empty_or_malformed_conductor_lists_are_usage_errors(cmd, conductor, hint):
    """Issue 17: ``kvmesh generate --conductor ","`` printed a ValueError traceback, and a
    malformed address was dialled anyway (no port: 443; port 99999: 34463)."""
    argv = [cmd, *(["hi"] if cmd == "generate" else ["--once"]), "--conductor", conductor]
    out = subprocess.run(
        [sys.executable, "-m", "kvmesh.services.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert "argument --conductor:" in out.stderr and hint in out.stderr, out.stderr


def test_conductor_addresses_accept_what_grpc_dials():
    from kvmesh.services.client import conductor_addresses

    good = "127.0.0.1:50051, [::1]:7,kvmesh-conductor:50051,dns:///svc.ns:50051,unix:/run/k.sock"
    assert conductor_addresses(good) == [
        "127.0.0.1:50051",
        "[::1]:7",
        "kvmesh-conductor:50051",
        "dns:///svc.ns:50051",
        "unix:/run/k.sock",
    ]
    for bad, _ in BAD_CONDUCTORS:
        with pytest.raises(ValueError):
            conductor_addresses(bad)
