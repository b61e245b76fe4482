#!/bin/bash
# One rank of a Slurm job step (srun, one task per GPU), with the environment trainer_pipe.py reads from a launcher:
#   srun --kill-on-bad-exit=1 scripts/slurm_rank.sh trainer_pipe.py -cp conf -cn llama_65b
# Under supervise.py (docs/reliability.md#restart-on-failure), srun's exit code is the failed rank's. The master's
# port follows the job id (below the kernel's ephemeral ports): two jobs whose first node is the same do not meet.
export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS
export LOCAL_SIZE=${SLURM_NTASKS_PER_NODE:-$((SLURM_NTASKS / SLURM_NNODES))}
export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
export MASTER_PORT=${MASTER_PORT:-$((10000 + SLURM_JOB_ID % 20000))}
exec python "$@"
