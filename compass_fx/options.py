"""The options a user can pass as ``torch.compile(model, backend="compass", options={...})``.

Every option is checked here, once, so that a typo is a clear ``ValueError`` naming the option
instead of a silently ignored setting.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .kernels.schedules import SCHEDULES as SCHEDULE_CHOICES

STRATEGY_CHOICES = ("auto", "off", "decompose", "fuse")  # what the user asks for; the cost model's
#                                                           outcomes are cost.decision.STRATEGIES
INNER_CHOICES = ("inductor", "eager")


@dataclass(frozen=True)
class CompassOptions:
    """Validated options.

    strategy: "auto" lets the cost model choose per pair; "off" leaves every graph as it is (the
        pairs are still found and reported); "decompose" forces InterDecom (into ``chunks`` parts,
        else as many parts as the group has ranks); "fuse" forces the fused operators with
        ``schedule``.  :meth:`forced` is the whole rule.
    chunks: forces the InterDecom part count (implies strategy "decompose" under "auto"; 1 keeps
        pairs sequential).  The option keeps this name; everywhere else (Decision, report, cost
        model) the count is ``parts``.
    inner: the compiler that receives the rewritten graphs.
    dump_dir: where each graph's code is written before and after the rewrite.
    group: only collectives of this process group name are touched (None: all groups).
    topology: a preset name or a Topology object for the cost model (None: its default).
    schedule: the fused operators' schedule when strategy is "fuse".
    auto_fuse: whether "auto" may choose the fused operators (GPUs only; "fuse" forces them
        anywhere).  None (default): only where the group's GPUs have no peer access (host-staged:
        PCIe cards, or ``NCCL_P2P_DISABLE=1``), where the fused operators, moving data through
        pinned host memory on the copy engines, were measured 1.07-1.6x faster per pair than
        NCCL + cuBLAS on 2 H200s; True: on peer links too; False: never.
    mode: Inductor's ``torch.compile`` mode ("max-autotune", "reduce-overhead", ...) for the inner
        Inductor compile; ``torch.compile(..., mode=...)`` sets it too (torch.compile takes either
        ``mode`` or ``options``, not both).  None: Inductor's defaults.
    fused_async: fused reduce-scatter / all-reduce pairs run as ``*_start`` calls moved up to just
        after their inputs, with a ``wait_tensor`` just before the first use of the result, so that
        the work between (a weight gradient beside an input gradient's all-reduce) runs while the
        pieces travel and are summed on a side stream.  A call with nothing but views between
        its operands and its first use (the forward's, read at once) stays a plain call: a deferred
        call replays its CUDA graph on a stream of its own, with events to order that stream with
        the caller's and a join at the wait, which costs the host more than a plain call, and
        ``auto`` prices its host so.  False (default): the call returns with its result complete.
    calibration: a file written by ``compass-fx calibrate`` on this machine; the cost model prices
        with its measured constants (None: ``$COMPASS_FX_CALIBRATION`` if set, else datasheet
        constants).  A file from another version, or measured on another GPU than the topology's,
        is an error.
    """

    strategy: str = "auto"
    chunks: int | None = None
    inner: str = "inductor"
    dump_dir: str | None = None
    group: str | None = None
    topology: Any = None
    schedule: str = "double_ring"
    auto_fuse: bool | None = None
    mode: str | None = None
    calibration: str | None = None
    fused_async: bool = False

    def forced(self, group_size: int) -> tuple[str, int, str | None] | None:
        """``(strategy, parts, schedule)`` that these options force on a pair of ``group_size``
        ranks, or None when the cost model chooses ("auto" without ``chunks``).  The one place
        where the options' precedence lives: off, then chunks / decompose, then fuse."""
        if self.strategy == "off":
            return ("sequential", 1, None)
        if self.strategy == "decompose" or self.chunks is not None:
            parts = self.chunks if self.chunks is not None else group_size
            return ("decompose", parts, None) if parts > 1 else ("sequential", 1, None)
        if self.strategy == "fuse":
            return ("fuse", 1, self.schedule)
        return None

    def captures_cuda_graphs(self) -> bool:
        """Whether ``mode`` makes Inductor replay the compiled graphs as CUDA graphs
        ("reduce-overhead", "max-autotune"): the cost model then charges no host issue."""
        if self.mode is None:
            return False
        import torch._inductor

        return bool(torch._inductor.list_mode_options(self.mode).get("triton.cudagraphs"))

    def cache_key(self) -> str:
        """A stable digest of everything that changes what the pass produces."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["topology"] = getattr(self.topology, "name", self.topology)
        return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _group_name(value: Any) -> str | None:
    """Accept a group name, a ProcessGroup or a 1-D DeviceMesh and return the group's name."""
    if value is None or isinstance(value, str):
        return value
    if hasattr(value, "get_group"):  # DeviceMesh
        if getattr(value, "ndim", 1) != 1:
            raise ValueError("option 'group': pass a 1-D DeviceMesh (e.g. mesh['tp']), "
                             f"got a {value.ndim}-D mesh")
        value = value.get_group()
    if hasattr(value, "group_name"):
        return value.group_name
    raise ValueError(f"option 'group' must be a group name, a ProcessGroup or a 1-D DeviceMesh, got {value!r}")


def _check_names(raw: Mapping[str, Any]) -> None:
    """One line naming each unknown option, its likely meaning, and every valid option."""
    known = sorted(f.name for f in dataclasses.fields(CompassOptions))
    unknown = sorted(set(raw) - set(known))
    if not unknown:
        return
    guesses = [g for name in unknown for g in difflib.get_close_matches(name, known, n=1)]
    hint = f" (did you mean {', '.join(map(repr, guesses))}?)" if guesses else ""
    raise ValueError(f"unknown compass option(s) {unknown}{hint}; valid options: {', '.join(known)}")


def _check_mode(mode: Any) -> None:
    """``mode`` picks Inductor's config preset; an unknown one would otherwise fail mid-compile."""
    import torch._inductor

    modes = tuple(torch._inductor.list_mode_options())
    if mode not in modes:
        raise ValueError(f"option 'mode' must be one of {modes}, got {mode!r}")


def parse_options(options: Mapping[str, Any] | CompassOptions | None = None, **extra: Any) -> CompassOptions:
    """Validate user options (a dict, keywords, or both) into ``CompassOptions``."""
    if isinstance(options, CompassOptions):
        raw = dataclasses.asdict(options)
    elif options is None:
        raw = {}
    elif isinstance(options, Mapping):
        raw = dict(options)
    else:
        raise ValueError(f"options must be a dict, got {type(options).__name__}")
    raw.update(extra)
    _check_names(raw)

    strategy = raw.get("strategy", "auto")
    if strategy not in STRATEGY_CHOICES:
        raise ValueError(f"option 'strategy' must be one of {STRATEGY_CHOICES}, got {strategy!r}")
    chunks = raw.get("chunks")
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"option 'chunks' must be a positive int, got {chunks!r}")
    if chunks is not None and strategy in ("off", "fuse"):
        raise ValueError(f"option 'chunks' cannot be combined with strategy={strategy!r}")
    inner = raw.get("inner", "inductor")
    if inner not in INNER_CHOICES:
        raise ValueError(f"option 'inner' must be one of {INNER_CHOICES}, got {inner!r}")
    schedule = raw.get("schedule", "double_ring")
    if schedule not in SCHEDULE_CHOICES:
        raise ValueError(f"option 'schedule' must be one of {SCHEDULE_CHOICES}, got {schedule!r}")
    dump_dir = raw.get("dump_dir")
    if dump_dir is not None:
        if not isinstance(dump_dir, (str, Path)):
            raise ValueError(f"option 'dump_dir' must be a path, got {dump_dir!r}")
        dump_dir = str(dump_dir)
    topology = raw.get("topology")
    if isinstance(topology, str):
        from .machine.topology import Topology

        try:
            Topology.resolve(topology)  # an unknown preset fails here, not deep inside a compile
        except (ValueError, OSError) as e:
            raise ValueError(f"option 'topology': {e}") from None
    elif topology is not None and not hasattr(topology, "graph"):
        raise ValueError(f"option 'topology' must be a preset name, a file or a Topology, got {topology!r}")
    auto_fuse = raw.get("auto_fuse")
    if auto_fuse is not None and not isinstance(auto_fuse, bool):
        raise ValueError(f"option 'auto_fuse' must be True, False or None, got {auto_fuse!r}")
    mode = raw.get("mode")
    if mode is not None:
        _check_mode(mode)
    fused_async = raw.get("fused_async", False)
    if not isinstance(fused_async, bool):
        raise ValueError(f"option 'fused_async' must be True or False, got {fused_async!r}")
    calibration = raw.get("calibration")
    if calibration is not None:
        calibration = _check_calibration(calibration, topology)
    return CompassOptions(strategy=strategy, chunks=chunks, inner=inner, dump_dir=dump_dir,
                          group=_group_name(raw.get("group")), topology=topology,
                          schedule=schedule, auto_fuse=auto_fuse, mode=mode, calibration=calibration,
                          fused_async=fused_async)


def _check_calibration(path: Any, topology: Any) -> str:
    """The file must load, and hold constants for the GPU of the topology when one is named."""
    from .machine.calibration import calibrated_gpus

    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"option 'calibration' must be a file path, got {path!r}")
    try:
        gpus = calibrated_gpus(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"option 'calibration': {e}") from None
    if topology is not None:
        check_calibration_matches(str(path), gpus, topology)
    return str(path)


def check_calibration_matches(path: str, gpus: tuple[str, ...], topology: Any) -> None:
    """A calibration measured on other GPUs than the topology's would price the wrong machine."""
    from .machine.topology import Topology

    topo = Topology.resolve(topology)
    if topo.gpu not in gpus:
        raise ValueError(f"option 'calibration': {path} was measured on {', '.join(gpus) or 'no GPU'}, but the "
                         f"topology {topo.name} has {topo.gpu} GPUs: calibrate on this machine or drop the file")



def check_options(options: Mapping[str, Any] | None = None, /, **extra: Any) -> CompassOptions:
    """Validate options before ``torch.compile``, as ``check_options(chunks=4)`` or ``check_options({...})``.

    The backend runs this same check, but only at the model's first call (``torch.compile`` hands a
    backend its options then, not before); here it is raised at once.
    """
    return parse_options(options, **extra)
