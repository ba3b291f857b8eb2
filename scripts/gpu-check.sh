#!/usr/bin/env bash
# The GPU check of issue 14 part 2, for one NVIDIA GPU (an H200: 16 cores, torch 2.11 +
# CUDA 13, Python 3.12) with NO network, in under 8 minutes, from the repository root of
# a copy of this tree. It downloads nothing:
#
#   * Python packages it lacks come from a folder of wheels the operator copied in
#     (default ./wheels, or --wheels DIR / KVMESH_WHEELS): pip install --no-index
#     --find-links DIR. torch is the machine's own; kvmesh itself goes in --no-deps (its
#     engine extra pins another torch); where pip cannot install it (no setuptools), a
#     PYTHONPATH shim maps the top-level folders to kvmesh.* instead.
#   * etcd is taken from PATH, else from --etcd DIR / KVMESH_ETCD_DIR, else ./wheels/etcd
#     (e.g. the binary unpacked from Debian's etcd-server .deb: dpkg-deb -x).
#
# Then it runs, each step bounded by a timeout (110 + 210 + 90 s: the whole check stays
# under 8 minutes with the set-up) and logged:
#   (a) the CUDA tests but the cluster: pytest -m cuda (tests/test_cuda.py: the staging
#       hand-off; tests/test_cuda_decode.py: the device sampler with one sync, CUDA-graph
#       replay against the eager decode step);
#   (b) python -m kvmesh.loadtest.bench_engine --device cuda (loadtest/bench_gpu.py):
#       llama-1b (~1.1 B params, random bfloat16 weights) against transformers on the
#       same GPU (skipped with a note where transformers is not installed): prefill
#       tok/s, the hand-off's cost, decode ms/step through CUDA graphs and eagerly;
#   (c) one cluster, 1 prefill + 1 decode node sharing the GPU (etcd, conductor, real
#       processes), serving a request token-exact against the single-process reference
#       (tests/test_cuda_cluster.py).
# Figures and logs go to $OUT (or ./gpu-check-out): cuda-tests.txt, engine_cuda.json,
# bench_engine_cuda.txt, cuda-cluster.txt, summary.txt. Exit status: non-zero if a step
# failed.
#
#   bash scripts/gpu-check.sh [--wheels DIR] [--etcd DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${KVMESH_WHEELS:-wheels}
ETCD_DIR=${KVMESH_ETCD_DIR:-}
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS=$2; shift 2 ;;
    --etcd) ETCD_DIR=$2; shift 2 ;;
    -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
    *) echo "gpu-check: unknown argument $1 (--wheels DIR, --etcd DIR)" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
note() { echo "gpu-check: $*" | tee -a "$SUMMARY"; }
START=$(date +%s)

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  note "torch sees no CUDA device: nothing to check here (run it on the GPU machine)"
  exit 1
fi
"$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))' | tee -a "$SUMMARY"

# --- set up what is missing, offline --------------------------------------------------
if [ -d "$WHEELS" ]; then
  # the base dependencies and the test tools, never torch (the machine's stays)
  REQS=$("$PY" - <<'PY'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
extra = [r for r in p["optional-dependencies"]["engine"] if not r.startswith("torch")]
print("\n".join(p["dependencies"] + extra + ["pytest", "pytest-asyncio", "transformers"]))
PY
)
  while IFS= read -r r; do  # one by one: a missing wheel is a note, not a stop
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" "$r" >/dev/null 2>&1 \
      || "$PY" -c "import importlib.metadata as m, re; m.version(re.split('[<>=!~ ]', '$r')[0])" 2>/dev/null \
      || note "no wheel for $r in $WHEELS (and not installed)"
  done <<< "$REQS"
fi
if ! "$PY" -c 'import kvmesh.protos.kvmesh_pb2' 2>/dev/null; then
  if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1; then
    SHIM=$(mktemp -d)/shim
    mkdir -p "$SHIM/kvmesh"
    cp kvmesh/*.py "$SHIM/kvmesh/"
    for d in services rdma protos loadtest; do ln -s "$PWD/$d" "$SHIM/kvmesh/$d"; done
    export PYTHONPATH="$SHIM:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    note "kvmesh not installable here (no setuptools?): using the PYTHONPATH shim $SHIM"
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # tests/ imports tests.cluster_util
if ! command -v etcd >/dev/null; then
  for d in "$ETCD_DIR" "$WHEELS/etcd" "$WHEELS" "$WHEELS/usr/bin"; do
    if [ -n "$d" ] && [ -x "$d/etcd" ]; then export PATH="$(cd "$d" && pwd):$PATH"; break; fi
  done
fi
command -v etcd >/dev/null || note "no etcd on PATH nor in --etcd/wheels: the cluster test will fail"
"$PY" -c 'import kvmesh.protos.kvmesh_pb2' || { note "kvmesh does not import: stop"; exit 1; }

# --- (a) the CUDA tests, the cluster apart ----------------------------------------------
FAIL=0
timeout 110 "$PY" -m pytest -q -p no:cacheprovider -m cuda -rs \
  --ignore=tests/test_cuda_cluster.py tests/ 2>&1 | tee "$OUT/cuda-tests.txt"
rc=${PIPESTATUS[0]}
note "(a) pytest -m cuda: rc=$rc ($(tail -n 1 "$OUT/cuda-tests.txt"))"
[ "$rc" -eq 0 ] || FAIL=1

# --- (b) the engine on the GPU against transformers --------------------------------------
CMD=("$PY" -m kvmesh.loadtest.bench_engine --device cuda --out "$OUT/engine_cuda.json")
"$PY" -c 'import transformers' 2>/dev/null || { CMD+=(--no-transformers); note "transformers not installed: (b) runs kvmesh alone"; }
echo "${CMD[*]}" > "$OUT/bench_engine_cuda.cmd"
timeout 210 "${CMD[@]}" 2>&1 | tee "$OUT/bench_engine_cuda.txt"
rc=${PIPESTATUS[0]}
note "(b) bench_engine --device cuda: rc=$rc"
[ "$rc" -eq 0 ] || FAIL=1

# --- (c) one cluster on the GPU, token-exact against the reference -----------------------
timeout 90 "$PY" -m pytest -q -p no:cacheprovider -m cuda -rs tests/test_cuda_cluster.py \
  2>&1 | tee "$OUT/cuda-cluster.txt"
rc=${PIPESTATUS[0]}
note "(c) one cluster, token-exact: rc=$rc ($(tail -n 1 "$OUT/cuda-cluster.txt"))"
[ "$rc" -eq 0 ] || FAIL=1

note "done in $(( $(date +%s) - START )) s; results in $OUT"
exit $FAIL
