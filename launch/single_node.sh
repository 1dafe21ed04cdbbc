#!/usr/bin/env bash
# Train on one node with torchrun, one process per GPU.
#
# Usage: launch/single_node.sh [--config configs/NAME.yaml] [section.key=value ...]
#   e.g. launch/single_node.sh --config configs/llama-100m-fp8.yaml optim.lr=8e-4
# Runs from the repository root whatever the current directory, so config, data and run
# paths are relative to the repository root. A restarted or relaunched run resumes from
# the latest checkpoint in its train.run_dir.
#
# Environment:
#   GPUS             processes (GPUs) on this node (default 8)
#   MAX_RESTARTS     times torchrun restarts the workers after a failure (default 3)
#   OMP_NUM_THREADS  CPU threads per process (default: CPU cores / GPUS, at least 1)
#   TORCHRUN         launcher command (default: torchrun, or "$PYTHON -m torch.distributed.run"
#                    when PYTHON is set)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

GPUS="${GPUS:-8}"
MAX_RESTARTS="${MAX_RESTARTS:-3}"
# shellcheck source=launch/common.sh
source launch/common.sh "$GPUS"

exec "${launcher[@]}" \
    --standalone \
    --nnodes 1 \
    --nproc-per-node "$GPUS" \
    --max-restarts "$MAX_RESTARTS" \
    train "$@"
