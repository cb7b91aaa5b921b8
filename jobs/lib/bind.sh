#!/usr/bin/env bash
# Per-rank wrapper (started by srun or mpirun once per rank): when the rank sees several GPUs,
# keep the one of its node-local rank, so each rank owns exactly one GPU; then exec the program
# (exec: the launcher's signals reach python itself). A no-op on CPU-only nodes.
local_rank=${SLURM_LOCALID:-${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-${PMI_LOCAL_RANK:-0}}}}
if [[ -n ${CUDA_VISIBLE_DEVICES:-} && ${HPCGNN_GPU_BIND:-1} == 1 ]]; then
    IFS=, read -r -a gpus <<< "$CUDA_VISIBLE_DEVICES"
    if (( ${#gpus[@]} > 1 )); then
        export CUDA_VISIBLE_DEVICES=${gpus[local_rank % ${#gpus[@]}]}
    fi
fi
exec "$@"
