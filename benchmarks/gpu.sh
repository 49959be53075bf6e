#!/usr/bin/env bash
# One-command GPU benchmark (<= 8 minutes on one GPU): MAE ViT-B/16 (mask 0.75, bf16, batch 256)
# and CLIP ViT-B/32 (bf16, batch 256) beside open_clip_train, on shards it writes itself.
#   bash benchmarks/gpu.sh [--out DIR] [--workers N] [--skip-open-clip]
#   bash benchmarks/gpu.sh --dry-run      # CPU, fp32, batch 2, 2 steps of each: checks the wiring
# Needs only the project with its bench extra (pip install -e ".[bench]": open_clip_train imports pandas).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python benchmarks/gpu_bench.py "$@"
