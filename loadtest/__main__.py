"""``python -m loadtest``: the default comparison: real-cluster baselines (loadtest.run)
then the paper-scale simulator (loadtest.sim); both write into loadtest/results/ and
rebuild report.md. Extra arguments go to loadtest.run (e.g. ``--quick``)."""

import sys

from loadtest import run, sim  # noqa: F401
from loadtest.sim.__main__ import main as sim_main

if __name__ == "__main__":
    rc = run.main(sys.argv[1:])
    sys.exit(rc or sim_main([]))
