"""``python -m kvmesh.services.launcher [flags]``: the same as ``kvmesh up [flags]`` (the
flags, the checks and the exit code are ``kvmesh up``'s: :mod:`kvmesh.services.cli`)."""

from __future__ import annotations

import sys

from kvmesh.services.cli import main

if __name__ == "__main__":
    main(["up", *sys.argv[1:]])
