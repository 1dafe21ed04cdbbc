#!/usr/bin/env bash
# Train on several nodes with torchrun and c10d rendezvous; run this once on every node.
#
# Usage: NNODES=2 HEAD_NODE_ADDR=node001 launch/multi_node.sh [--config FILE] [section.key=value ...]
#   e.g. on each of 4 nodes:
#        NNODES=4 HEAD_NODE_ADDR=10.0.0.1 launch/multi_node.sh --config configs/llama-1b.yaml
# Nodes need no rank: c10d rendezvous assigns them. Runs from the repository root whatever
# the current directory; the repository, data.dir and train.run_dir must be on storage that
# every node sees. A restarted run resumes from the latest checkpoint in train.run_dir.
#
# Parallelism: HSDP by default, parameters and optimizer state sharded over the GPUs of a
# node and replicated across nodes: the override parallel.replicas=$NNODES is appended
# (it wins over the config file) unless the arguments give parallel.replicas themselves.
# Pass parallel.replicas=1 to shard over every GPU of the job (plain FSDP: least memory,
# all gradient traffic across nodes), or another divisor of NNODES to shard over groups of
# nodes.
#
# Environment:
#   NNODES           number of nodes (required)
#   HEAD_NODE_ADDR   address of the node that hosts the rendezvous (required)
#   GPUS_PER_NODE    processes (GPUs) per node (default 8)
#   RDZV_PORT        rendezvous port on the head node (default 29500)
#   RDZV_ID          job id shared by all nodes of one run (default srtrain)
#   MAX_RESTARTS     times torchrun restarts the workers after a failure (default 3)
#   OMP_NUM_THREADS  CPU threads per process (default: CPU cores / GPUS_PER_NODE, at least 1)
#   TORCHRUN         launcher command (default: torchrun, or "$PYTHON -m torch.distributed.run"
#                    when PYTHON is set)
# NCCL settings (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, ...) pass through from the environment.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

: "${NNODES:?set NNODES to the number of nodes}"
: "${HEAD_NODE_ADDR:?set HEAD_NODE_ADDR to the address of the rendezvous host}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
RDZV_PORT="${RDZV_PORT:-29500}"
RDZV_ID="${RDZV_ID:-srtrain}"
MAX_RESTARTS="${MAX_RESTARTS:-3}"
# shellcheck source=launch/common.sh
source launch/common.sh "$GPUS_PER_NODE"

# HSDP across nodes unless the arguments choose parallel.replicas.
replicas=("parallel.replicas=$NNODES")
for arg in "$@"; do
    [[ "$arg" == parallel.replicas=* ]] && replicas=()
done

exec "${launcher[@]}" \
    --nnodes "$NNODES" \
    --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$HEAD_NODE_ADDR:$RDZV_PORT" \
    --rdzv-id "$RDZV_ID" \
    --max-restarts "$MAX_RESTARTS" \
    train "$@" ${replicas[@]+"${replicas[@]}"}
