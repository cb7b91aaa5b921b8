"""What ``python -m hpcgnn info`` reports: the MPI library, CUDA-awareness, devices, torch."""
from __future__ import annotations

import os

import torch

from hpcgnn.comm import gpu


def describe() -> dict[str, str]:
    import mpi4py
    from mpi4py import MPI
    from hpcgnn.comm.context import mpi_library
    major, minor = MPI.Get_version()
    cuda = torch.cuda.is_available()
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    setting = os.environ.get(gpu.ENV_CUDA_AWARE)
    aware = gpu.mpi_is_cuda_aware()
    how = f"from {gpu.ENV_CUDA_AWARE}={setting}" if setting is not None else "queried from the library"
    return {
        "mpi library": mpi_library(),
        "mpi standard": f"{major}.{minor}",
        "mpi4py": mpi4py.__version__,
        "cuda-aware mpi": f"{'yes' if aware else 'no'} ({how})",
        "torch": torch.__version__,
        "cuda": f"{torch.version.cuda} available" if cuda else "not available",
        "devices": ", ".join(devices) if devices else "cpu only",
        "threads": str(torch.get_num_threads()),
        "world size": str(MPI.COMM_WORLD.Get_size()),
    }
