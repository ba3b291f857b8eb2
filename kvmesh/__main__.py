"""``python -m kvmesh`` is the ``kvmesh`` command line."""

import sys

from kvmesh.services.cli import main

sys.exit(main())
