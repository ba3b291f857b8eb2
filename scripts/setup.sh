#!/usr/bin/env bash
# Installs what a fresh Debian/Ubuntu machine lacks to run and test kvmesh:
# etcd (etcd-server), docker-compose and kubectl (kubernetes-client; to validate the
# compose file and the Kubernetes manifests), and this project
# with its test extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
# kubectl kustomize renders deploy/k8s in tests/test_k8s.py
command -v kubectl >/dev/null 2>&1 || need+=(kubernetes-client)
if [ ${#need[@]} -gt 0 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# A Debian package may start etcd as a system service on :2379; kvmesh runs its own.
python -m pip install -q --disable-pip-version-check -e '.[test]'
command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
