"""The machine's measured figures: the calibration file ``compass-fx calibrate`` writes, which one
is in force, and the GPU constants and collective timings it refines the datasheets with.

A calibration file holds fitted GPU constants ({"gpus": {name: fields}}) and, optionally, NCCL
timings per regime, op and group size ({"collectives": [...]}), each read into a
``seconds = a + b * bytes`` line.  The one in force is the backend option's during its compile,
else ``$COMPASS_FX_CALIBRATION``; without one every figure is the datasheet's (``machine.gpus``).
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import os
from pathlib import Path
from typing import Iterator, Sequence

from .gpus import GPUS, GpuSpec, gpu_name_from_device
from .links import PEER_TO_PEER

CALIBRATION_ENV = "COMPASS_FX_CALIBRATION"
CALIBRATION_FORMAT = "compass-fx-calibration"
CALIBRATION_VERSION = 1
# The calibration the backend's ``calibration=`` option names, for the compile in progress.
_option_calibration: contextvars.ContextVar[Path | None] = contextvars.ContextVar("compass_calibration",
                                                                                 default=None)


def calibration_path() -> Path | None:
    """The calibration in force: the backend option's (during its compile), else $COMPASS_FX_CALIBRATION."""
    chosen = _option_calibration.get()
    if chosen is not None:
        return chosen
    value = os.environ.get(CALIBRATION_ENV)
    return Path(value) if value else None


def calibration_in_use() -> str:
    """For reports: which calibration priced a decision."""
    path = calibration_path()
    return f"calibration file {path}" if path is not None else "datasheet (no calibration)"


@contextlib.contextmanager
def use_calibration(path: "str | os.PathLike | None") -> Iterator[None]:
    """Price with the calibration file ``path`` inside the block (None: leave things as they are)."""
    if path is None:
        yield
        return
    token = _option_calibration.set(Path(path))
    try:
        yield
    finally:
        _option_calibration.reset(token)


def calibrated_collective(regime: str, op: str, group_size: int) -> tuple[float, float] | None:
    """(seconds fixed, seconds per byte) of ``op`` over ``group_size`` ranks in ``regime``
    (``links.PEER_TO_PEER`` or ``HOST_STAGED``), fitted once per file to the calibration's measurements;
    None when the calibration in force (if any) did not measure it."""
    path = calibration_path()
    if path is None:
        return None
    if str(path) not in _collective_lines:
        _collective_lines[str(path)] = {
            (t.get("regime", PEER_TO_PEER), t["op"], int(t["group_size"])): fit_latency_bandwidth(t["points"])
            for t in _read_calibration(path).get("collectives", [])}
    return _collective_lines[str(path)].get((regime, op, group_size))


_collective_lines: dict[str, dict[tuple[str, str, int], tuple[float, float]]] = {}


def calibrated_fused_host() -> dict | None:
    """The host costs of a fused call measured by ``compass-fx calibrate`` on this machine
    ({"launch_s": {command kind: seconds}, "dispatch_s": seconds}); None when the calibration in
    force (if any) holds none."""
    path = calibration_path()
    if path is None:
        return None
    if str(path) not in _fused_host:  # read once per file, as the collectives and the GPU constants
        found = _read_calibration(path).get("fused_host")
        ok = isinstance(found, dict) and isinstance(found.get("launch_s"), dict)
        _fused_host[str(path)] = found if ok else None
    return _fused_host[str(path)]


_fused_host: dict[str, dict | None] = {}


def calibrated_gpus(path: "str | os.PathLike") -> tuple[str, ...]:
    """The GPU models a calibration file holds constants for."""
    return tuple(load_calibration(path))


_loaded: dict[str, dict[str, GpuSpec]] = {}


def _read_calibration(path: "str | os.PathLike") -> dict:
    """The file's contents once its shape, format and version are checked."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), dict):
        raise ValueError(f"calibration file {path}: expected an object with a 'gpus' mapping")
    if data.get("format") != CALIBRATION_FORMAT or data.get("version") != CALIBRATION_VERSION:
        raise ValueError(f"calibration file {path} is {data.get('format') or 'an unversioned file'} version "
                         f"{data.get('version')!r}; this compass-fx reads {CALIBRATION_FORMAT} version "
                         f"{CALIBRATION_VERSION}: run compass-fx calibrate again on this machine")
    return data


def load_calibration(path: str | os.PathLike) -> dict[str, GpuSpec]:
    """Read a calibration file written by ``compass-fx calibrate``: {"gpus": {name: fields}}.

    Only the fields present override the built-in spec, so a file may refine just the
    efficiency and overheads.
    """
    out = {}
    for name, fields in _read_calibration(path)["gpus"].items():
        base = GPUS.get(name)
        if base is None:
            out[name] = GpuSpec.from_dict({"name": name, **fields})
        else:
            merged = base.to_dict() | fields
            out[name] = GpuSpec.from_dict(merged)
    return out


def gpu_spec(gpu: "str | GpuSpec") -> GpuSpec:
    """Look up a GPU by name (case-insensitive, "RTX 4090" works), applying the calibration file
    named by $COMPASS_FX_CALIBRATION when one is set."""
    if isinstance(gpu, GpuSpec):
        return gpu
    key = str(gpu).replace(" ", "").upper()
    key = {k.upper(): k for k in GPUS}.get(key) or gpu_name_from_device(str(gpu))
    if key is None:
        raise ValueError(f"gpu must be one of {sorted(GPUS)}, got {gpu!r}")
    path = calibration_path()
    if path is not None:
        cache_key = str(path)
        if cache_key not in _loaded:
            _loaded[cache_key] = load_calibration(path)
        if key in _loaded[cache_key]:
            return _loaded[cache_key][key]
    return GPUS[key]


def write_calibration(path: "str | Path", specs: Sequence[GpuSpec], extra: dict | None = None) -> None:
    """A calibration file :func:`load_calibration` reads: format, version, {"gpus": {name: constants}}, and
    ``extra`` (the device it was measured on, how many measurements, ...)."""
    keep = ("efficiency", "kernel_overhead_s", "wave_overhead_s", "tiles", "max_split_k", "graph_part_overhead_s",
            "source")
    data = {"format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION,
            "gpus": {s.name: {k: v for k, v in s.to_dict().items() if k in keep} for s in specs}}
    data.update(extra or {})
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def fit_latency_bandwidth(points: Sequence[Sequence[float]]) -> tuple[float, float]:
    """(seconds fixed, seconds per byte) of ``seconds = a + b * bytes`` fitted to measured points in
    relative error (small messages count as much as large ones); a >= 0, b > 0."""
    if len(points) < 2:
        raise ValueError("a collective's table needs at least two message sizes")
    w = [1.0 / max(s, 1e-12) for _, s in points]
    sw = sum(wi * wi for wi in w)
    sx = sum(wi * wi * x for wi, (x, _) in zip(w, points))
    sy = sum(wi * wi * y for wi, (_, y) in zip(w, points))
    sxx = sum(wi * wi * x * x for wi, (x, _) in zip(w, points))
    sxy = sum(wi * wi * x * y for wi, (x, y) in zip(w, points))
    det = sw * sxx - sx * sx
    b = (sw * sxy - sx * sy) / det if det else 0.0
    a = (sy - b * sx) / sw
    if a < 0 or b <= 0:  # a line through the origin then (or a flat one): never a negative part
        b = max(sum(y / x for x, y in points) / len(points), 1e-18)
        a = 0.0
    return a, b
