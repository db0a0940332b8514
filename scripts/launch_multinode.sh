#!/usr/bin/env bash
# Launch a flowrl run on several nodes with `accelerate launch`. Run this script once on EVERY node,
# with the same arguments; each node starts GPUS_PER_NODE processes and joins node 0's rendezvous.
#
# Usage:
#   scripts/launch_multinode.sh CONFIG [KEY=VALUE ...]
#
# Environment (first match wins; SLURM_* variables are the fallback inside an sbatch/srun job):
#   MASTER_ADDR     address of node 0, reachable from every node  (SLURM: first host of SLURM_JOB_NODELIST;
#                   required when NNODES > 1, 127.0.0.1 on a single node)
#   MASTER_PORT     a free TCP port on node 0                      (default 29500)
#   NNODES          number of nodes                                (SLURM_JOB_NUM_NODES / SLURM_NNODES; default 1)
#   NODE_RANK       rank of this node, 0 .. NNODES-1               (SLURM_NODEID / SLURM_PROCID; default 0)
#   GPUS_PER_NODE   processes per node                             (SLURM_GPUS_ON_NODE, else nvidia-smi's GPU count)
#   ACCELERATE_CONFIG  accelerate config file  (default configs/accelerate/ddp_8gpu.yaml, or
#                   ddp_1gpu.yaml for a single process in all; its
#                   num_processes/num_machines/machine_rank are overridden by the values above)
#   PYTHON          interpreter to use         (default .venv/bin/python if present, else python)
#   DRY_RUN=1       print the command instead of running it
#
# Examples:
#   # two nodes by hand: on node 0 ...
#   MASTER_ADDR=10.0.0.1 NNODES=2 NODE_RANK=0 scripts/launch_multinode.sh configs/sd35_medium/grpo_ocr.yaml
#   # ... and on node 1
#   MASTER_ADDR=10.0.0.1 NNODES=2 NODE_RANK=1 scripts/launch_multinode.sh configs/sd35_medium/grpo_ocr.yaml
#
#   # SLURM: one task per node, each task runs this script
#   #SBATCH --nodes=2 --ntasks-per-node=1 --gpus-per-node=8
#   srun scripts/launch_multinode.sh configs/flux1_dev/grpo_pickscore.yaml train.epochs=500
#
# Notes: prompts_per_batch in the flowrl config is per process, so the global batch grows with the
# number of processes. Every node needs the repository, the model weights (or Hub access) and the
# same run_dir: every rank writes its RNG state into the checkpoint directory and rank 0 the
# rest, so run_dir must be on a file system all nodes share.
set -euo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit $(( $# < 1 ? 2 : 0 ))
fi

absolute() {  # an existing file's absolute path, so paths given relative to the caller's cwd survive the cd
    if [[ -f "$1" ]]; then echo "$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"; else echo "$1"; fi
}
CONFIG="$(absolute "$1")"
shift
if [[ -n "${ACCELERATE_CONFIG:-}" ]]; then ACCELERATE_CONFIG="$(absolute "$ACCELERATE_CONFIG")"; fi

# Relative paths inside flowrl configs (prompt files, run_dir) are relative to the repository root.
cd "$(dirname "${BASH_SOURCE[0]}")/.."

first_slurm_host() {
    if [[ -n "${SLURM_JOB_NODELIST:-}" ]] && command -v scontrol >/dev/null 2>&1; then
        scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1
    fi
}

count_gpus() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --list-gpus | wc -l
    else
        echo 1
    fi
}

NNODES="${NNODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}}"
MASTER_ADDR="${MASTER_ADDR:-$(first_slurm_host)}"
if [[ -z "$MASTER_ADDR" ]]; then
    if [[ "$NNODES" != "1" ]]; then
        echo "launch_multinode.sh: set MASTER_ADDR to node 0's address (NNODES=$NNODES)" >&2
        exit 2
    fi
    MASTER_ADDR=127.0.0.1
fi
MASTER_PORT="${MASTER_PORT:-29500}"
NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-${SLURM_PROCID:-0}}}"
GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-$(count_gpus)}}"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi

for name in NNODES NODE_RANK GPUS_PER_NODE MASTER_PORT; do
    if ! [[ "${!name}" =~ ^[0-9]+$ ]]; then
        echo "launch_multinode.sh: $name must be a non-negative integer, got '${!name}'" >&2
        exit 2
    fi
done
if (( NNODES < 1 || GPUS_PER_NODE < 1 || NODE_RANK >= NNODES )); then
    echo "launch_multinode.sh: need NNODES >= 1, GPUS_PER_NODE >= 1 and NODE_RANK < NNODES" \
         "(got NNODES=$NNODES GPUS_PER_NODE=$GPUS_PER_NODE NODE_RANK=$NODE_RANK)" >&2
    exit 2
fi
NUM_PROCESSES=$(( NNODES * GPUS_PER_NODE ))
if [[ -z "${ACCELERATE_CONFIG:-}" ]]; then  # accelerate refuses MULTI_GPU with a single process
    if (( NUM_PROCESSES == 1 )); then
        ACCELERATE_CONFIG=configs/accelerate/ddp_1gpu.yaml
    else
        ACCELERATE_CONFIG=configs/accelerate/ddp_8gpu.yaml
    fi
fi
for file in "$CONFIG" "$ACCELERATE_CONFIG"; do
    if [[ ! -f "$file" ]]; then
        echo "launch_multinode.sh: config file not found: $file" >&2
        exit 2
    fi
done

cmd=("$PYTHON" -m accelerate.commands.launch
     --config_file "$ACCELERATE_CONFIG"
     --num_machines "$NNODES"
     --machine_rank "$NODE_RANK"
     --main_process_ip "$MASTER_ADDR"
     --main_process_port "$MASTER_PORT"
     --num_processes "$NUM_PROCESSES"
     -m flowrl train "$CONFIG" "$@")

echo "node $NODE_RANK/$NNODES: $GPUS_PER_NODE processes, $NUM_PROCESSES in all, rendezvous $MASTER_ADDR:$MASTER_PORT" >&2
if [[ "${DRY_RUN:-0}" == "1" ]]; then
    printf '%q ' "${cmd[@]}"
    echo
else
    exec "${cmd[@]}"
fi
