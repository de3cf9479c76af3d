"""Fused communication+matmul operators (``torch.ops.compass.*``) and their schedules.

Importing this package registers the custom ops.  The CUDA implementation talks to the driver
through ctypes only when a CUDA tensor arrives, so the package imports on machines without a GPU.
"""
from .ops import (all_gather_matmul, fused_schedules_available, matmul_all_reduce,
                  matmul_reduce_scatter)
from .schedules import SCHEDULES, all_gather_schedule, reduce_scatter_schedule

__all__ = [
    "SCHEDULES",
    "all_gather_matmul",
    "all_gather_schedule",
    "fused_schedules_available",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "reduce_scatter_schedule",
]
