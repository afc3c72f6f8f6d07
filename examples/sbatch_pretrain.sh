#!/bin/bash
# Multi-node pretraining on SLURM: one task per node, each starting torchrun with one process per GPU.
#
#   sbatch examples/sbatch_pretrain.sh                         # the TinyLlama recipe on 2 x 8 GPUs
#   sbatch --nodes=4 examples/sbatch_pretrain.sh --data.train_streams '[s3://bucket/a, s3://bucket/b]'
#
# Arguments after the script name are passed on to `toolkit pretrain` (after --config, so they win).
# Environment: CONFIG (recipe), GPUS_PER_NODE, MASTER_PORT, TOOLKIT_VENV (a venv to activate).
# The run resumes from its newest checkpoint (--resume auto), so resubmitting the same script after a
# time limit or a node failure continues it; chain jobs with `sbatch --dependency=afterany:<jobid> ...`.
#
# See tutorials/distributed.md for what each setting does.

#SBATCH --job-name=toolkit-pretrain
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=slurm-%x-%j.out

set -euo pipefail

export CONFIG="${CONFIG:-config_hub/pretrain/tinyllama.yaml}"
export GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
# The first node of the allocation hosts the rendezvous; every node reaches it on MASTER_PORT.
export MASTER_ADDR="${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}"
export MASTER_PORT="${MASTER_PORT:-29500}"
if [[ -n "${TOOLKIT_VENV:-}" ]]; then
    # shellcheck disable=SC1091
    source "$TOOLKIT_VENV/bin/activate"
fi

# Data-loading and tokenizer threads per process: the node's CPUs shared among its GPU processes.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( ${SLURM_CPUS_PER_TASK:-$GPUS_PER_NODE} / GPUS_PER_NODE ))}"
export TOKENIZERS_PARALLELISM=false

# NCCL: a failing rank ends the job instead of hanging until the timeout.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# Uncomment and adapt to your cluster (see `ip addr` and `ibv_devinfo` on a compute node):
# export NCCL_SOCKET_IFNAME=ib0          # the interface for NCCL's bootstrap / socket traffic
# export NCCL_IB_HCA=mlx5_0,mlx5_1       # the InfiniBand adapters to use
# export NCCL_IB_DISABLE=1               # no InfiniBand: use TCP sockets (slow; for debugging)

# SLURM_NNODES and SLURM_NODEID are set by srun in each node's task. `srun` (SRUN) is a variable so
# that the line below can be tried without SLURM: SRUN= SLURM_NNODES=1 SLURM_NODEID=0 ... bash this-file
${SRUN-srun --kill-on-bad-exit=1} bash -c '
    exec torchrun \
        --nnodes="$SLURM_NNODES" --node_rank="$SLURM_NODEID" --nproc_per_node="$GPUS_PER_NODE" \
        --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" \
        -m toolkit pretrain --config "$CONFIG" \
        --devices "$GPUS_PER_NODE" --num_nodes "$SLURM_NNODES" --resume auto "$@"
' toolkit-pretrain "$@"
