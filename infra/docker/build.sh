#!/usr/bin/env bash
# Builds the images the Kubernetes manifests run (names from infra/generate.py: IMAGE_CPU, IMAGE_GPU).
# Usage (from anywhere): infra/docker/build.sh [cpu|cuda|all]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
images="$(cd "$root" && python -c 'import sys; sys.path.insert(0, "infra"); import generate; print(generate.IMAGE_CPU, generate.IMAGE_GPU)')"
read -r cpu_image gpu_image <<<"$images"
case "${1:-all}" in
  cpu) docker build -f "$root/infra/docker/Dockerfile.cpu" -t "$cpu_image" "$root" ;;
  cuda) docker build -f "$root/infra/docker/Dockerfile.cuda" -t "$gpu_image" "$root" ;;
  all)
    docker build -f "$root/infra/docker/Dockerfile.cpu" -t "$cpu_image" "$root"
    docker build -f "$root/infra/docker/Dockerfile.cuda" -t "$gpu_image" "$root"
    ;;
  *) echo "usage: $0 [cpu|cuda|all]" >&2; exit 2 ;;
esac
