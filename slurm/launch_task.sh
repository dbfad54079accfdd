#!/usr/bin/env bash
# One training process of a Slurm launch: run under `srun`, one task per GPU (or per CPU worker).
#
#   srun [srun options] slurm/launch_task.sh [--cpu] PROGRAM [ARGS...]
#
# Runs PROGRAM ARGS... followed by fairseq's explicit distributed flags, derived from Slurm's
# environment, so the same command works on one task, on one node and across nodes:
#   --distributed-world-size $SLURM_NTASKS  --device-id $SLURM_LOCALID
# and, when there is more than one task,
#   --distributed-rank $SLURM_PROCID  --distributed-no-spawn
#   --distributed-init-method tcp://$MASTER_ADDR:$MASTER_PORT
# MASTER_ADDR defaults to the first host of the job's node list and MASTER_PORT to a port derived
# from the job id (20000 + id % 20000); export either to override. GPUs use fairseq's default
# backend (NCCL). --cpu adds `--cpu --distributed-backend gloo --ddp-backend legacy_ddp`: CPU
# training needs gloo, and pytorch_ddp / torchrun-style env init do not work there.
# OMP_NUM_THREADS, when unset, becomes the task's CPU count ($SLURM_CPUS_PER_TASK, else 1 like
# torchrun): without CPU binding every task's torch would otherwise start one thread per core
# of the node, oversubscribing it N times over, and a run's numbers would depend on the node's
# core count instead of its allocation.
# Both `alma-sweep submit` jobs and single runs (sbatch --wrap "srun slurm/launch_task.sh ...")
# launch through this script.
set -euo pipefail

device_flags=()
if [[ ${1:-} == --cpu ]]; then
  device_flags=(--cpu --distributed-backend gloo --ddp-backend legacy_ddp)
  shift
fi
if [[ $# -lt 1 ]]; then
  echo "usage: srun slurm/launch_task.sh [--cpu] PROGRAM [ARGS...]" >&2
  exit 2
fi
if [[ -z ${SLURM_PROCID:-} || -z ${SLURM_NTASKS:-} || -z ${SLURM_JOB_ID:-} ]]; then
  echo "launch_task.sh: SLURM_PROCID/SLURM_NTASKS/SLURM_JOB_ID are unset: start it with srun" >&2
  exit 2
fi

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}

world_size=$SLURM_NTASKS
dist_flags=(--distributed-world-size "$world_size" --device-id "${SLURM_LOCALID:-0}")
if ((world_size > 1)); then
  if [[ -z ${MASTER_ADDR:-} ]]; then
    MASTER_ADDR=$(scontrol show hostnames "${SLURM_JOB_NODELIST:?}" | head -n 1)
  fi
  MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
  export MASTER_ADDR MASTER_PORT
  dist_flags+=(--distributed-rank "$SLURM_PROCID" --distributed-no-spawn
    --distributed-init-method "tcp://$MASTER_ADDR:$MASTER_PORT")
fi

exec "$@" "${dist_flags[@]}" "${device_flags[@]}"
