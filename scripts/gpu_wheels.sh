#!/usr/bin/env bash
# Fill .gpu_wheels/ (git-ignored) with the wheels shardspeed and its tests need beyond what the
# lent GPU machine ships (it has torch, transformers, accelerate and peft, and no network):
# pydantic (its compiled core for CPython 3.10-3.13), hjson, pytest and pytest-timeout.
# Carry the folder to the device: run(command="bash scripts/gpu_check.sh", carry=[".gpu_wheels"]).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu_wheels
for version in 3.10 3.11 3.12 3.13; do
  python -m pip download -q -d .gpu_wheels --only-binary=:all: --python-version "$version" \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    "pydantic>=2" hjson "pytest>=8" "pytest-timeout>=2.3"
done
du -sh .gpu_wheels
