#!/usr/bin/env bash
# Per-rank wrapper (started by srun or mpirun once per rank): when the rank sees several GPUs,
# keep the one of its node-local rank, so each rank owns exactly one GPU; then exec the program
# (exec: the launcher's signals reach python itself). A no-op on CPU-only nodes.
# USR1 (the preemption warning) is ignored from here until the program installs its own
# handler (hpcgnn train does, first thing): one that arrives while python starts, imports
# mpi4py and joins MPI is dropped instead of killing the rank. Before this line bash's default
# action kills the rank, so the job script passes USR1 on only once hpcgnn train says every rank
# handles it (jobs/lib/common.sh, hpcgnn_run_forwarding), and again until the ranks have ended.
trap '' USR1
# The local rank the launcher of the ranks set, before SLURM's: under mpirun in a batch job every
# rank inherits the batch step's SLURM_LOCALID=0 (Open MPI's mpirun and MPICH's alike).
local_rank=${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-${SLURM_LOCALID:-${PMI_LOCAL_RANK:-0}}}}
if [[ -n ${CUDA_VISIBLE_DEVICES:-} && ${HPCGNN_GPU_BIND:-1} == 1 ]]; then
    IFS=, read -r -a gpus <<< "$CUDA_VISIBLE_DEVICES"
    if (( ${#gpus[@]} > 1 )); then
        export CUDA_VISIBLE_DEVICES=${gpus[local_rank % ${#gpus[@]}]}
    fi
fi
exec "$@"
