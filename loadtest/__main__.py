"""``python -m kvmesh.loadtest``: the realistic evaluation (loadtest.eval): colocated vs
disaggregated-without-store vs kvmesh on two pinned model nodes, ~20 minutes on 2 cores;
``--quick`` runs every phase small. It writes loadtest/results/eval.json and rebuilds
report.md (with the simulator's section when sim.json is there: ``python -m
kvmesh.loadtest.sim``)."""

import sys

from kvmesh.loadtest.eval import main

if __name__ == "__main__":
    sys.exit(main())
