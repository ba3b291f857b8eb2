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
