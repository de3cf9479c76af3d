"""The CUDA path of the fused operators: :mod:`..protocol`'s plans run on real GPUs.

``impl`` (the operators: workspaces, streams, the plan's commands as launches), ``driver`` (the few
CUDA driver calls, through ctypes), ``host_memory`` (host memory a group maps, where GPUs without
peer access meet), ``watchdog`` (bounded waits).  :mod:`..ops` imports ``impl`` only when it is
handed a CUDA tensor or asked about the CUDA device, and ``driver`` loads the driver library only
at its first call, so all of it imports on machines without a GPU.
"""

import os

_ENV_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None


def env(name: str, default: str) -> str:
    """``os.environ.get(name, default)``, read from the dict CPython keeps behind ``os.environ`` on
    POSIX (kept current by every assignment to ``os.environ``): ~0.2 us against 2-3 us on the lent
    H200 host, and a fused call reads a few such settings (they may change between calls)."""
    if _ENV_DATA is not None:
        raw = _ENV_DATA.get(name.encode())
        return default if raw is None else raw.decode("utf-8", "surrogateescape")
    return os.environ.get(name, default)


def env_raw(name: bytes) -> bytes | None:
    """The raw value of environment variable ``name`` (bytes) or None: one dict lookup, for the
    settings read on every call, whose parsed values are kept per raw value."""
    if _ENV_DATA is not None:
        return _ENV_DATA.get(name)
    value = os.environ.get(name.decode())
    return None if value is None else value.encode()


def graphs_enabled() -> bool:
    """``COMPASS_FUSED_GRAPHS=1``: the fused operators may be captured in CUDA graphs (each
    workspace gets a twin for captured calls, ``impl``); read when ``compass_fx.kernels`` is
    imported, too, to let Inductor's CUDA graphs take the ops in (``..ops``)."""
    return env("COMPASS_FUSED_GRAPHS", "0").strip().lower() in ("1", "true", "yes", "on")


def graph_buffer_sets() -> int:
    """``COMPASS_FUSED_GRAPH_BUFFERS`` (1, the default, or 2): sets of buffers of a captured call's
    workspace.  One set: a call's first write into a symmetric buffer waits until every peer has
    finished reading the previous call's (in a trace of a 4096-row host-staged gather on one H200,
    ~85 us per call).  Two sets: it waits for the last call that used the same set, which costs
    nothing in that trace, for twice the memory; yet timed there it was slower (1.05 against 0.94
    ms per call, in turns within one run; the two ranks share that GPU's copy engines and PCIe
    link, and a rank's pulls waited longer for its peer's publications: not yet explained), so
    the default stays one until two GPUs measure it.  Every rank must set it alike (checked when a
    workspace is built)."""
    raw = os.environ.get("COMPASS_FUSED_GRAPH_BUFFERS", "1").strip()
    if raw not in ("1", "2"):
        raise ValueError(f"COMPASS_FUSED_GRAPH_BUFFERS must be 1 or 2, got {raw!r}")
    return int(raw)
