"""The CUDA path of the fused operators: :mod:`..protocol`'s plans run on real GPUs.

``impl`` (the operators: workspaces, streams, the plan's commands as launches), ``driver`` (the few
CUDA driver calls, through ctypes), ``host_memory`` (host memory a group maps, where GPUs without
peer access meet), ``watchdog`` (bounded waits).  :mod:`..ops` imports ``impl`` only when it is
handed a CUDA tensor or asked about the CUDA device, and ``driver`` loads the driver library only
at its first call, so all of it imports on machines without a GPU.
"""
