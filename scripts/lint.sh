#!/usr/bin/env bash
# Lint, format check and type check; CI runs this before the tests.
#   bash scripts/lint.sh
# mypy sees the packages under their installed names (kvmesh.rdma, ...) through a
# staging tree of symlinks, since the repository keeps services/, rdma/, protos/ and
# loadtest/ at its top and maps them with setuptools' package-dir.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
ruff check .
ruff format --check .
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/kvmesh"
ln -s "$ROOT/kvmesh/__init__.py" "$STAGE/kvmesh/__init__.py"
for d in services rdma protos loadtest; do ln -s "$ROOT/$d" "$STAGE/kvmesh/$d"; done
(cd "$STAGE" && mypy --config-file "$ROOT/pyproject.toml" \
    -p kvmesh.rdma -p kvmesh.services.common -p kvmesh.services.conductor \
    -p kvmesh.services.store_master -p kvmesh.services.planner)
