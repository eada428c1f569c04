#!/usr/bin/env bash
# Wheels the GPU machine lacks (its image has torch, Triton, transformers and pytest), for Python
# 3.12 on x86-64, into .whl/ (git-ignored): carry it to the device with the working tree
# (`run` with carry [".whl"]); scripts/gpu_check.sh installs them there. Versions: this venv's.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
rm -rf .whl && mkdir -p .whl
for name in pydantic pydantic_core annotated-types typing-inspection llguidance; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 -d .whl "$name==$(version "$name")"
done
du -sh .whl
