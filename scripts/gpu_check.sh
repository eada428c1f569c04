#!/usr/bin/env bash
# The GPU check, run on a lent CUDA machine from the repository root, under 8 minutes on an H200:
#   1. the `gpu`-marked tests (Triton kernels compiled against their torch references, greedy
#      tokens on CUDA against HF on CUDA, decode graphs, KV sizing) -> gpu_tests.xml / .log
#   2. benchmarks/engine_throughput.py --device cuda (Llama-3-8B shape, random bf16 weights,
#      against HF on the same GPU) -> cuda_throughput.json
# Results go to $OUT (the device tool's folder) or benchmarks/results/gpu. Before: run
# scripts/gpu_wheels.sh here and carry .whl (pydantic, llguidance, ... the image lacks).
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${OUT:-benchmarks/results/gpu}
mkdir -p "$RESULTS"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TANDEM_CACHE_DIR=/tmp/tandem-cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$RESULTS/gpu.csv" 2>&1
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee "$RESULTS/versions.txt"
started=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_kernels.py tests/test_gpu.py \
  --junitxml="$RESULTS/gpu_tests.xml" 2>&1 | tee "$RESULTS/gpu_tests.log"
echo "gpu tests: $(( $(date +%s) - started )) s"
timeout 330 python3 benchmarks/engine_throughput.py --device cuda --output "$RESULTS/cuda_throughput.json" \
  >"$RESULTS/cuda_bench.log" 2>&1
echo "benchmark rc $?; total $(( $(date +%s) - started )) s"
tail -40 "$RESULTS/cuda_bench.log"
