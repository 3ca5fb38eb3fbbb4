#!/bin/bash
# Run a recipe on several nodes with plain torchrun (no SLURM): start this script on every node.
#
#   # on each of the 16 nodes (NODE_RANK 0..15), with node 0's address as MASTER_ADDR:
#   NNODES=16 NODE_RANK=3 MASTER_ADDR=10.0.0.1 bash recipes/torchrun-multinode.sh recipes/qwen2.5-72b-pretrain.yaml
#
# What it does on each node: a dry run of the node's ranks on one CPU (`lightning-hybrid dry-run`), the network preflight on the training mesh (all nodes together), then
# `lightning-hybrid fit` under torchrun's elastic agent:
#   * a training process that crashes (or a lost NCCL peer that times out) makes every agent stop its workers and
#     start them again, up to MAX_RESTARTS times, through a new rendezvous; `fit` resumes from the newest valid
#     checkpoint in the recipe's dirpath (FaultTolerantCheckpoint auto_resume).
#   * SIGTERM or SIGUSR1 to torchrun (a scheduler's preemption notice) is forwarded to the training processes,
#     which save a checkpoint and exit with code 75; the agent waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT for them.
#   * a hung training process (no progress for the recipe's hang_timeout) ends every worker the same way.
#   * with MIN_NODES < NNODES (--nnodes MIN:MAX), a node lost for good is left out: the agents that remain form the
#     job again with fewer nodes (dp smaller, tp and pp unchanged, the checkpoint resharded on load); NNODES x
#     GPUS_PER_NODE / (tp x pp) must stay a whole number at every size in between, and the global batch must
#     still divide. A node that comes back joins at the next restart.
#   * restarts used up, or fewer than MIN_NODES left: run this script again on every node; it resumes.
#   * GPUHealthMonitor (72B recipes) stops the run on a GPU fault with exit code 76 and writes the faulty hosts to
#     <dirpath>/exclude_hosts.txt. Plain torchrun cannot choose nodes: on a listed host this script refuses to start
#     (exit 76) and says so; the operator replaces the node (Kubernetes: `kubectl cordon HOST` and let the job
#     reschedule) and removes the line from the file. Other nodes print the listed hosts and go on.
#
# Environment: NNODES (nodes, default 1), NODE_RANK (this node, 0 on the rendezvous host), MASTER_ADDR (address of
# node 0), MASTER_PORT (29500), GPUS_PER_NODE (8), MAX_RESTARTS (3), MIN_NODES (NNODES: no shrinking), RUN_DIR (shared folder the recipe's relative
# checkpoints/, logs/ and data/ live in; default: the current directory), TP/PP (for the preflight, 8/2), GPU
# (expected figures of the preflight, b300).
set -euo pipefail

RECIPE=${1:-recipes/qwen2.5-72b-pretrain.yaml}
RECIPE=$(realpath "$RECIPE")                   # absolute: the run happens in RUN_DIR
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MAX_RESTARTS=${MAX_RESTARTS:-3}
MIN_NODES=${MIN_NODES:-$NNODES}
RUN_DIR=${RUN_DIR:-$PWD}
TP=${TP:-8}
PP=${PP:-2}
GPU=${GPU:-b300}
RUN_ID=${RUN_ID:-$(basename "$RECIPE" .yaml)}  # rendezvous id: the same string on every node

# ---- NCCL over InfiniBand / RoCE (explained in docs/deployment.md; check the names with `ibstat` and `ip link`)
export NCCL_IB_HCA=${NCCL_IB_HCA:-mlx5}                     # the ConnectX HCAs, one per GPU
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker}  # interfaces for bootstrap/socket traffic
export NCCL_IB_GID_INDEX=${NCCL_IB_GID_INDEX:-3}            # RoCE v2 GID (ignored on native InfiniBand)
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}               # IB retransmit timeout 4.096 us x 2^22
export NCCL_IB_RETRY_CNT=${NCCL_IB_RETRY_CNT:-7}            # IB retries before an error is fatal
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1                     # a failed or timed-out collective aborts (no hang)
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}                        # INFO to see the transports NCCL picked
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export PYTHONUNBUFFERED=1
# ---- preemption: forward SIGUSR1 too (not in torchrun's default list) and wait for the checkpoint
export TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-110}
# ---- in-job restarts: a fresh rendezvous store each round (the shared one keeps the dead round's keys)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

# c10d rendezvous on node 0: it hosts the store (is_host makes that explicit where the hostname does not resolve
# to MASTER_ADDR, e.g. behind NAT or with several interfaces). Ranks are handed out as agents join, and each
# agent's GPUS_PER_NODE workers get consecutive ranks, so a TP group (tp <= GPUS_PER_NODE) stays inside a node.
IS_HOST=$([ "$NODE_RANK" = "0" ] && echo 1 || echo 0)
torchrun_args() {  # torchrun_args PORT [MIN_NODES]: a fixed number of nodes, or MIN:MAX (elastic)
    local nodes=$NNODES
    if [ "${2:-$NNODES}" != "$NNODES" ]; then nodes="$2:$NNODES"; fi
    echo --nnodes "$nodes" --nproc_per_node "$GPUS_PER_NODE" --rdzv_backend c10d \
        --rdzv_endpoint "$MASTER_ADDR:$1" --rdzv_conf "is_host=$IS_HOST"
}

mkdir -p "$RUN_DIR"
cd "$RUN_DIR"

# ---- hosts GPUHealthMonitor found faulty: this node must not rejoin if it is one of them
# shellcheck source=slurm/exclude_hosts.sh
source "$(dirname "$(realpath "$0")")/slurm/exclude_hosts.sh"
EXCLUDE_FILE=${EXCLUDE_FILE:-$RUN_DIR/$(recipe_checkpoint_dir "$RECIPE")/exclude_hosts.txt}
EXCLUDED=$(exclude_hosts_list "$EXCLUDE_FILE")
if [ -n "$EXCLUDED" ]; then
    if [ -n "$(hosts_in_list "$(hostname)" "$EXCLUDED")" ]; then
        echo "this node ($(hostname)) is listed as faulty in $EXCLUDE_FILE: not starting. Operator: replace it (Kubernetes:" \
             "kubectl cordon $(hostname)), start the run on healthy nodes, and remove the line once it is repaired" >&2
        exit 76
    fi
    echo "hosts excluded by GPUHealthMonitor ($EXCLUDE_FILE): $EXCLUDED; make sure none of them is in this job"
fi
echo "node $NODE_RANK of $NNODES: $RECIPE, rendezvous $MASTER_ADDR:$MASTER_PORT, run dir $RUN_DIR"

# ---- 0. dry run of this node's ranks on one CPU (fake process group, no GPU memory): a recipe that cannot build or
# does not fit fails here in minutes, on every node, before any rendezvous. DRY_RUN=0 skips it.
if [ "${DRY_RUN:-1}" = "1" ]; then
    FIRST_RANK=$((NODE_RANK * GPUS_PER_NODE))
    NODE_RANKS=$(seq -s, "$FIRST_RANK" "$((FIRST_RANK + GPUS_PER_NODE - 1))")
    lightning-hybrid dry-run --config "$RECIPE" --ranks "$NODE_RANKS" --gpu "$GPU" > "dry-run-node$NODE_RANK.txt"
fi

# ---- 1. preflight on the training mesh: exits non-zero naming the host, GPU and link below 80% of expected
# shellcheck disable=SC2046  # word splitting of torchrun_args is intended
torchrun $(torchrun_args "$((MASTER_PORT + 1))") --rdzv_id "$RUN_ID-preflight" --max-restarts 0 \
    "$(command -v lightning-hybrid)" preflight --tp "$TP" --pp "$PP" --gpu "$GPU" --threshold 0.8 --json \
    > "preflight-node$NODE_RANK.json"

# ---- 2. training with elastic restarts; exec so that signals reach torchrun directly
# shellcheck disable=SC2046
exec torchrun $(torchrun_args "$MASTER_PORT" "$MIN_NODES") --rdzv_id "$RUN_ID" --max-restarts "$MAX_RESTARTS" \
    "$(command -v lightning-hybrid)" fit --config "$RECIPE"
