"""``python -m kvmesh.loadtest``: the default comparison, under 10 minutes on 2 cores:
real-cluster baselines (loadtest.run, at two offered loads unless ``--time-scales`` is
given) then the paper-scale simulator (loadtest.sim); both write into loadtest/results/
and rebuild report.md. Extra arguments go to loadtest.run (e.g. ``--quick``)."""

import sys

from kvmesh.loadtest import run, sim  # noqa: F401
from kvmesh.loadtest.sim.__main__ import main as sim_main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(a.startswith("--time-scales") for a in argv) and "--quick" not in argv:
        argv += ["--time-scales", "1,0.5"]
    rc = run.main(argv)
    sys.exit(rc or sim_main([]))
