# env/site.sh — this cluster's settings, sourced by every job in jobs/ before the venv is
# activated (and by env/site-mpi.sh). Copy this file to env/site.sh and edit; keep it out of the
# library. Everything here is an example: uncomment what your cluster needs.

# --- modules (the same ones env/site-mpi.sh built mpi4py against) ----------------------------
# module purge
# module load gcc/12.3 openmpi/4.1.6 cuda/12.4
# module load cray-mpich craype-accel-nvidia80          # Cray EX

# --- where things go ---------------------------------------------------------------------------
# export HPCGNN_VENV=$HOME/hpcgnn/.venv-site            # the venv env/site-mpi.sh built
# export HPCGNN_RUNS=/scratch/$USER/hpcgnn/runs         # run directories (default: ./runs)
# export HDF5_USE_FILE_LOCKING=FALSE                    # a file system that refuses locks (NFS)

# --- launcher ------------------------------------------------------------------------------------
# export HPCGNN_LAUNCHER=srun                           # auto | srun | mpirun
# export HPCGNN_SRUN_MPI=pmix                           # srun --mpi=...; see `srun --mpi=list`
# export HPCGNN_SRUN_MPI=cray_shasta                    # Cray EX
# export I_MPI_PMI_LIBRARY=/usr/lib64/libpmi2.so        # Intel MPI under srun --mpi=pmi2

# --- network -------------------------------------------------------------------------------------
# Open MPI over TCP: name the fast interface (or a CIDR), for MPI traffic and for start-up.
# export OMPI_MCA_btl_tcp_if_include=ib0                # or 10.10.0.0/16
# export OMPI_MCA_oob_tcp_if_include=ib0
# Open MPI over UCX (InfiniBand/RoCE), CUDA-aware when UCX is built with CUDA:
# export OMPI_MCA_pml=ucx UCX_NET_DEVICES=mlx5_0:1
# export UCX_TLS=rc,sm,cuda_copy,cuda_ipc,gdr_copy
# MPICH / Cray MPICH over libfabric:
# export FI_PROVIDER=cxi                                # Slingshot; verbs on InfiniBand
# export MPICH_GPU_SUPPORT_ENABLED=1                    # Cray MPICH: device buffers in MPI

# --- GPUs ----------------------------------------------------------------------------------------
# export HPCGNN_CUDA_AWARE=1     # override what `python -m hpcgnn info` detects (1 or 0)
# export HPCGNN_GPU_BIND=0       # let srun --gpu-bind do it instead of jobs/lib/bind.sh
