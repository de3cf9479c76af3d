"""The CUDA path of the fused operators: :mod:`..protocol`'s plans run on real GPUs.

``impl`` (the operators: workspaces, streams, the plan's commands as launches), ``driver`` (the few
CUDA driver calls, through ctypes), ``host_memory`` (host memory a group maps, where GPUs without
peer access meet), ``watchdog`` (bounded waits).  :mod:`..ops` imports ``impl`` only when it is
handed a CUDA tensor or asked about the CUDA device, and ``driver`` loads the driver library only
at its first call, so all of it imports on machines without a GPU.
"""

import os


def graphs_enabled() -> bool:
    """``COMPASS_FUSED_GRAPHS=1``: the fused operators may be captured in CUDA graphs (each
    workspace gets a twin for captured calls, ``impl``); read when ``compass_fx.kernels`` is
    imported, too, to let Inductor's CUDA graphs take the ops in (``..ops``)."""
    return os.environ.get("COMPASS_FUSED_GRAPHS", "0").strip().lower() in ("1", "true", "yes", "on")
