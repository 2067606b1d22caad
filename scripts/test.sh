#!/usr/bin/env bash
# Install what the test suite needs (idempotent), check lint and format, run every test.
# This is the README's test command and what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."

# Real multi-node launcher backends are exercised with Debian's pdsh and OpenMPI.
if ! command -v pdsh >/dev/null || ! command -v mpirun >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pdsh openmpi-bin >/dev/null
  else
    echo "pdsh or mpirun is missing and cannot be installed here: those launcher tests will skip"
  fi
fi

# torch first, pinned: a looser requirement with no torch present would pull CUDA wheels.
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[dev]"

ruff check shardspeed tests examples benchmarks
ruff format --check shardspeed tests examples benchmarks
mypy shardspeed
python -m pytest -q "$@"
