"""Host time of one fused-operator call: what the cost model's host floor is built from.

A fused call is Python on the host: the custom op's dispatch, then one driver call or torch launch
per command of its plan (``compass_fx.kernels.protocol``).  When the GPU work of a call is short,
that host time, not the device, sets the pace.  This measures it on ONE GPU: two ranks in a gloo
group share the device and meet through host memory (the host-staged transport, which needs no
second GPU; ``--transport peer``: they map each other's buffers of the GPU with CUDA IPC and run
the peer transport's plans, as on an NVLink machine), so the GPU timings are no rank's own: the
host's are recorded, and a period (16 calls back to back) that compares ways of launching:

* per command kind, the host cost of the launch alone (``torch.mm(out=)``, ``cuMemcpyAsync``,
  ``cuStreamWriteValue32``, event record / wait ...);
* per configuration, the host microseconds of one call through ``torch.ops.compass`` (its result
  first checked against plain matmuls; for the reductions also the asynchronous ``*_start`` form
  with other work before its ``wait_tensor``, replayed and issued, checked the same way), through
  the ``.graph`` overload that rewritten graphs call (no Python autograd layers; an eager call
  replays a CUDA graph captured for its addresses, ``compass_fx.kernels.cuda.replay``), the same with
  ``COMPASS_FUSED_REPLAY=0`` (every command launched from Python, as before; each result checked
  too), and of the implementation called directly (the difference is the dispatcher's), the
  plan's commands by kind, and the cost model's ``fused_host_seconds`` for it; the ``.graph`` call
  also as a step issues it: back to back, and between a step's own eager ops (``step_ops``).  The forms of a
  case take turns within every round: the lent machines' hosts differ by up to 2x between runs,
  so only figures of one run compare.  ``--worlds 2,4,8``: one run per number of ranks sharing
  the GPU.

    python benchmarks/fused_host_time.py --worlds 2,4,8   # one GPU: writes fused_host_time-h200.{json,md}
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import output  # noqa: E402  (sets the no-multicast environment first)
from harness.ranks import pin  # noqa: E402
from harness.timing import host_us_per_call, spin, synchronize_polling  # noqa: E402
from join_handoff import hand_off  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

NAME = "fused_host_time"
TOLERANCE = 2e-2  # bf16 products summed in fp32 by cuBLAS, in a different order than the reference
# (operator, rows of A on one rank, k, n): llama3-8b widths at 512-8192 tokens, TP 2
CASES = [("all_gather_matmul", 256, 4096, 7168), ("all_gather_matmul", 1024, 4096, 7168),
         ("all_gather_matmul", 2048, 4096, 7168), ("all_gather_matmul", 4096, 4096, 7168),
         ("matmul_reduce_scatter", 512, 7168, 4096), ("matmul_reduce_scatter", 2048, 7168, 4096),
         ("matmul_reduce_scatter", 8192, 7168, 4096),
         ("matmul_all_reduce", 512, 7168, 4096), ("matmul_all_reduce", 2048, 7168, 4096),
         ("matmul_all_reduce", 8192, 7168, 4096)]
# gathers feeding several weights (n: their widths), as a sequence-parallel Llama-3 8B block's at TP 2: Q, K and
# V (2048 + 512 + 512 columns) and w1, w3 (2 x 7168) share their gathered rows: most gathers of a real model
WEIGHT_CASES = [("all_gather_matmul", 1024, 4096, (2048, 512, 512)), ("all_gather_matmul", 4096, 4096, (2048, 512, 512)),
                ("all_gather_matmul", 1024, 4096, (7168, 7168)), ("all_gather_matmul", 4096, 4096, (7168, 7168))]
CASE_SETS = {"default": CASES, "weights": WEIGHT_CASES}


def widths(n) -> tuple[int, ...]:
    """A case's weights' widths: ``n`` is one width, or a gather's widths (a tuple; a list in JSON)."""
    return tuple(n) if isinstance(n, (tuple, list)) else (n,)


BUSY_S = 2e-3  # the GPU's sleep before a "GPU busy" form's calls: longer than their issue
WARM_S = 3e-3  # the host's spin before a "warm host" form's calls (the GPU sleeps through it and BUSY_S)


_POLLING: list[bool] = [False]  # --sync poll: the timing loops wait for the device by polling


def wait_for_device() -> None:
    """How the timing loops wait for the device: CUDA's synchronize, in the context's sync mode
    (``--sync``), or with ``--sync poll`` first a busy loop on the current stream's query (no
    pause instruction, no sleep, no yield).  Why: the first call after a wait is slow on the host
    however the context waits (auto, spin, blocking), which would fit a host whose waiting core is
    handed to other work meanwhile (a virtual CPU that pauses or halts can be descheduled by its
    hypervisor); a core that polls never looks idle.  Measured: polling does not keep the first call
    fast either (``fused_host_time-h100-poll-*``: first of 16 still 2-6x its steady time)."""
    if _POLLING[0]:
        synchronize_polling()
    else:
        torch.cuda.synchronize()


def host_us(fns: dict, calls: int = 4, rounds: int = 15, busy: frozenset = frozenset(),
            in_turn: frozenset = frozenset(), warm: frozenset = frozenset()) -> dict[str, float]:
    """Median over rounds of the host microseconds per call of ``calls`` calls of each function,
    issued after the device went idle (few enough that no launch queue fills); the forms named in
    ``busy`` are issued while the GPU sleeps ``BUSY_S`` first instead, so the host issues them with
    the device busy behind it, as a step whose host runs ahead does (the first calls after a wait
    for the GPU pay for a host gone cold: on the lent H200 host up to 1.5-2x after a 10 ms wait).
    The functions take turns within every round, so a host that speeds up or slows down during
    the run (the lent machines' hosts differ by up to 2x between runs) moves them alike.  The forms
    named in ``in_turn`` are issued by one rank at a time, the others waiting at a barrier (rank 0
    from an idle GPU, each later one beside the earlier ranks' calls, which wait on the GPU for
    its flags): the host time of a call that no other process issues at the same moment, as on a
    machine with a GPU per rank, where the ranks' launches do not meet in one GPU's driver.  The
    forms named in ``warm`` are issued, the GPU busy as for ``busy``, after the host spun for
    ``WARM_S`` (a host that has just waited ~10 ms for the GPU is up to 1.5-2x slower for a while,
    and a large call's forms each follow a wait that long for the form before: a step's host,
    issuing without pause, is warm)."""
    from compass_fx.tools.timing import H200_CLOCK_HZ

    per_round: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            wait_for_device()
            if name in busy:
                torch.cuda._sleep(int(BUSY_S * H200_CLOCK_HZ))
            if name in warm:
                torch.cuda._sleep(int((BUSY_S + WARM_S) * H200_CLOCK_HZ))
                spin(WARM_S)
            if name not in in_turn:
                per_round[name].append(host_us_per_call(fn, calls))
                continue
            for turn in range(dist.get_world_size()):
                if turn == dist.get_rank():
                    per_round[name].append(host_us_per_call(fn, calls))
                dist.barrier()
    wait_for_device()
    return {name: statistics.median(v) for name, v in per_round.items()}


def period_us(fn, calls: int = 16, rounds: int = 5) -> dict[str, float]:
    """Microseconds per call of ``calls`` back-to-back calls, from an idle device until the last one
    finished (median over rounds): the pace the device sets for a large call, the host for a small
    one.  Every rank shares the one GPU, so this is no device time of a rank alone; it compares the
    ways of launching a call (say COMPASS_REPLAY_LAUNCH) measured alike.  Also the host's
    microseconds per call while it issues them (median over rounds): calls issued one after the
    other with no wait between, as a step issues them: on average (``issue``), the first call
    (``first``: right after the wait for the device) and the median of the others (``steady``: each
    issued while the calls before it run, as in a step)."""
    per_round, issue, first, steady = [], [], [], []
    for _ in range(rounds):
        wait_for_device()
        stamps = [time.perf_counter()]
        for _ in range(calls):
            fn()
            stamps.append(time.perf_counter())
        each = [(b - a) * 1e6 for a, b in zip(stamps, stamps[1:])]
        issue.append(sum(each) / calls)
        first.append(each[0])
        steady.append(statistics.median(each[1:]))
        wait_for_device()
        per_round.append((time.perf_counter() - stamps[0]) / calls * 1e6)
    return {"period_us": statistics.median(per_round), "host_us_back_to_back": statistics.median(issue),
            "host_us_first_of_16": statistics.median(first), "host_us_steady": statistics.median(steady)}


def step_ops(x: torch.Tensor) -> torch.Tensor:
    """What a sequence-parallel block issues eagerly between two of its fused calls, on activations
    the size of the call's: an RMSNorm and a SiLU-gated product (nine kernels, through the
    dispatcher and the caching allocator as a step's own ops are)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (torch.nn.functional.silu(h) * h).to(x.dtype)


def between_ops_us(fn, other, calls: int = 16, rounds: int = 5) -> dict[str, float]:
    """Host microseconds of a call issued between a step's other ops, as a training step issues it:
    ``other()`` then ``fn()``, ``calls`` times with no wait, only ``fn`` timed; the median of all
    but the first (right after the wait for the device), median over rounds.  Unlike the steady
    calls of :func:`period_us`, which follow one another, each of these follows other host work
    (the dispatcher, the allocator, other launches), which may leave the call's own path colder."""
    per_round = []
    for _ in range(rounds):
        wait_for_device()
        each = []
        for _ in range(calls):
            other()
            start = time.perf_counter()
            fn()
            each.append((time.perf_counter() - start) * 1e6)
        per_round.append(statistics.median(each[1:]))
        wait_for_device()
    return {"host_us_between_ops": statistics.median(per_round)}


def _phase_text(phases: dict | None) -> str:
    """A call's phases in C as one cell: the largest first."""
    if not phases:
        return "-"
    return ", ".join(f"{name} {us:.1f}" for name, us in sorted(phases.items(), key=lambda kv: -kv[1]))


OUTSIDE_C = "outside C"  # a call's host time less its phases in C: the op's wrapper in Python, the return


def phases_of_16(fn, calls: int = 16, rounds: int = 5) -> dict:
    """Where the host time of ``calls`` back-to-back calls goes, read from the fast path's own clock
    (:func:`compass_fx.kernels.cuda.lane.last_phases`: clock reads in C, no profiler), as
    :func:`period_us` issues them: the first call (right after the wait for the device) and the
    median of the others (steady), each phase's median over rounds, with the call's whole host time
    less those phases (``OUTSIDE_C``); calls the fast path declined are left out (``first_from_c``:
    the rounds whose first call C issued)."""
    from compass_fx.kernels.cuda import lane

    names = (*lane.PHASES, OUTSIDE_C)
    first, steady = [], []
    for _ in range(rounds):
        wait_for_device()
        got = []
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            whole = (time.perf_counter() - start) * 1e6
            phases = lane.last_phases()
            got.append(None if phases is None else {**phases, OUTSIDE_C: whole - sum(phases.values())})
        if got[0] is not None:
            first.append(got[0])
        rest = [g for g in got[1:] if g is not None]
        if rest:
            steady.append({k: statistics.median(g[k] for g in rest) for k in names})
        wait_for_device()

    def median(rows: list[dict]) -> dict | None:
        return {k: round(statistics.median(r[k] for r in rows), 2) for k in names} if rows else None

    return {"first": median(first), "steady": median(steady), "first_from_c": len(first), "rounds": rounds}


def launch_costs() -> dict[str, float]:
    """Host microseconds of each kind of launch a plan command makes, alone (what
    ``compass-fx calibrate`` measures for the cost model)."""
    from compass_fx.tools.calibrate import measure_fused_host

    return {kind: s * 1e6 for kind, s in measure_fused_host(calls=50)["launch_s"].items()}


def operands(op: str, rows: int, k: int, n, rank: int):
    """A rank's input and its weight (a list of weights where ``n`` holds several widths)."""
    g = torch.Generator(device="cuda").manual_seed(11 + rank)
    a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g) / k ** 0.5
    bs = [torch.randn(k, width, device="cuda", dtype=torch.bfloat16, generator=g) for width in widths(n)]
    return a, (bs if isinstance(n, (tuple, list)) else bs[0])


def weight_list(b) -> list:
    """A case's weights as a list (one, or a gather's several)."""
    return b if isinstance(b, list) else [b]


def weights_arg(op: str, b):
    """What the operator takes for ``b``: the gather a list of weights, the others the weight."""
    return weight_list(b) if op == "all_gather_matmul" else b


def relative_error(op: str, result, rows: int, k: int, n, rank: int, world: int) -> float:
    """Largest difference from plain matmuls of every rank's operands, over the largest element."""
    pairs = [operands(op, rows, k, n, r) for r in range(world)]
    if op == "all_gather_matmul":
        gathered = torch.cat([a for a, _ in pairs])
        return max(_relative(got, gathered @ b) for got, b in zip(result[1], weight_list(pairs[rank][1])))
    else:
        full = sum(a.float() @ b.float() for a, b in pairs)
        got, want = result, (full.chunk(world)[rank] if op == "matmul_reduce_scatter" else full)
    return _relative(got, want)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def python_profile(fn, calls: int = 40) -> list[dict]:
    """cProfile's top functions (own time per call) over ``calls`` calls of ``fn``."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    rows = [{"where": f"{os.path.basename(f)}:{line}:{name}", "calls": nc / calls, "self_us": tt / calls * 1e6,
             "cum_us": ct / calls * 1e6} for (f, line, name), (_, nc, tt, ct, _) in pstats.Stats(prof).stats.items()]
    return sorted(rows, key=lambda r: -r["self_us"])[:20]


def start_gemm_wait(start, wait, a: torch.Tensor, args: tuple, other: torch.Tensor):
    """The asynchronous form as fused_async's graphs run it: ``start`` a deferred call, a GEMM on the
    caller's stream while its pieces travel, then ``wait`` for its result (the start's and the wait's
    overloads or packets, as the caller times them)."""
    def started():
        out = start(a, *args)
        other @ other
        return wait(out)

    return started


def deferred_parts(start, wait, a: torch.Tensor, args: tuple, other: torch.Tensor, rounds: int,
                   profile: bool = False, packets: tuple | None = None) -> dict:
    """Where a deferred call's host time goes (``*_start``, a GEMM, ``wait_tensor``), without a
    profiler: forms timed in turns (``host_us``) against the whole call: start + wait with no GEMM
    between, the GEMM alone, and two of the start's steps on their own: the events that order a
    replayed deferred call's stream with the caller's (the four driver calls of
    ``_Workspace._replay_apart`` and its join's wait) and a c10d work registered for a tensor and
    taken back by ``wait_tensor`` (the hand-off of ``impl._register_join``, with a join that waits
    for nothing); and the whole call's phases read by the clock inside it (median over the calls
    of every round, the first after the device went idle among them).  ``profile``: cProfile's
    top functions of the whole call as well (its own overhead included).  ``packets``: the start's
    and the wait's packets, through which the whole call is timed too (the dispatcher's share: what
    the asynchronous form's runs before 2026-12-06 timed; both paths run the Python autograd wrapper
    torch registers for ``wait_tensor``)."""
    from compass_fx.kernels.cuda import driver
    from compass_fx.kernels.cuda import impl as cuda

    clock = time.perf_counter
    phases: dict[str, list[float]] = {"start": [], "gemm": [], "wait": []}

    def whole():
        t0 = clock()
        out = start(a, *args)
        t1 = clock()
        other @ other
        t2 = clock()
        done = wait(out)
        t3 = clock()
        phases["start"].append(t1 - t0)
        phases["gemm"].append(t2 - t1)
        phases["wait"].append(t3 - t2)
        return done

    side = torch.cuda.Stream(priority=-1).cuda_stream
    started, released, finished = driver.Event(), driver.Event(), driver.Event()
    record, wait_event = driver.raw("event_record"), driver.raw("stream_wait_event")

    def events():  # _replay_apart's order without the graph between (released is recorded by the graph)
        caller = cuda._raw_stream(a.get_device())
        result = (record(started.handle, caller) or wait_event(side, started.handle, 0)
                  or wait_event(caller, released.handle, 0) or record(finished.handle, side))
        driver.check(result, "deferred_parts' events")
        finished.wait_on(caller)

    forms = {"host_us_start_gemm_wait": whole, "host_us_start_wait": lambda: wait(start(a, *args)),
             "host_us_gemm": lambda: other @ other, "host_us_events": events,
             "host_us_register_wait": hand_off(torch.empty(1, device=a.device))}
    if packets is not None:
        start_packet, wait_packet = packets
        forms["host_us_start_gemm_wait_packets"] = start_gemm_wait(start_packet, wait_packet, a, args, other)
    res = host_us(forms, rounds=rounds)
    res.update({f"host_us_phase_{name}": statistics.median(v) * 1e6 for name, v in phases.items()})
    if profile:
        dist.barrier()
        res["profile"] = python_profile(whole)
    return res


def _workspace_of(op: str, rows: int, n=None):
    """The eager workspace the benchmark's calls of ``op`` with ``rows`` rows (and, for a gather, the
    weights' widths ``n``) use (not the asynchronous form's: its key ends in ``deferred`` = True)."""
    from compass_fx.kernels.cuda import impl as cuda

    short = {"all_gather_matmul": "ag", "matmul_reduce_scatter": "rs", "matmul_all_reduce": "ar"}[op]
    at = 4 if short == "ag" or short == "rs" else 3  # where the rows sit in the key
    found = [ws for (key, captured), ws in cuda._workspaces.items()
             if not captured and key[0] == short and key[at] == rows and not key[-1] and ws.replays is not None
             and (n is None or short != "ag" or key[6] == widths(n))]
    return found[-1] if len(found) == 1 else None


def _graph_nodes(ws, a, b, outs: list, gathered) -> dict:
    """Node kinds of the replay graph of one call (captured again and edited as a replay graph is,
    kept, never launched)."""
    from host_cost_probe import _node_kinds

    from compass_fx.kernels.cuda import replay

    tensors = {"A": [a], "W": weight_list(b), "OUT": outs}
    if gathered is not None:
        tensors["GATHERED"] = [gathered]
    stream = replay._capture_stream(ws.device_index)
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.stream(stream):
        g.capture_begin(capture_error_mode="thread_local")
        ws._issue(tensors, stream)
        g.capture_end()
    memset = replay.memset_kernel(ws.device_index)
    if memset:  # as the replay graph is launched (graph_edit)
        replay.edit(g.raw_cuda_graph(), memset)
    kinds = _node_kinds(g.raw_cuda_graph())
    del g
    return kinds


def breakdown(op: str, rows: int, k: int, n, world: int, group_name: str, a, b, rounds: int,
              schedule: str = "direct") -> dict:
    """Where a replayed call's host microseconds go, without a profiler's overhead: forms timed in
    turns (every rank runs the same sequence: launches are collective).  ``call``: the ``.graph``
    call; ``alloc_launch``: the same outputs allocated, the epoch raised and the call's replay
    graph launched, with the progress count the call keeps, and nothing else; ``alloc``: the
    outputs' allocations alone; ``alloc_one_row``: as many allocations of one row each (whether an
    output's allocation costs more the larger it is, as the breakdowns suggest).  So launch =
    alloc_launch - alloc, the rest of the call (checks, the workspace's key and lookup, the replay's
    bookkeeping) = call - alloc_launch; and the launch with the ranks in turn (``host_us``'s
    ``in_turn``: no other rank launches at the same moment)."""
    from compass_fx.kernels.cuda import impl as cuda

    ws = _workspace_of(op, rows, n)
    if ws is None or ws.progress is None:
        return {"error": "no single replaying workspace with a progress count"}
    args = (weights_arg(op, b), schedule, group_name, world)
    graph_op = getattr(torch.ops.compass, op).graph
    out_rows = {"all_gather_matmul": rows * world, "matmul_reduce_scatter": rows // world,
                "matmul_all_reduce": rows}[op]

    def allocations(gathered_rows: int, rows_out: int):
        gathered = a.new_empty((gathered_rows, k)) if op == "all_gather_matmul" else None  # first, as the call
        return gathered, [a.new_empty((rows_out, width)) for width in widths(n)]

    def alloc():
        return allocations(rows * world, out_rows)

    def alloc_one_row():  # as many allocations of one row each: does an output's cost grow with its size?
        return allocations(1, 1)

    missing = []

    def alloc_launch():
        gathered, outs = alloc()
        tensors = {"A": [a], "W": weight_list(b), "OUT": outs}
        if gathered is not None:
            tensors["GATHERED"] = [gathered]
        ws.epoch += 1
        graphs = ws.replays.graphs.get(ws._addresses(tensors))
        graph = graphs[ws.epoch % len(graphs)] if graphs else None
        if graph is None:  # every rank then issues the call, as the op would
            missing.append(ws.epoch)
            ws.epoch -= 1
            graph_op(a, *args)
            return
        p = ws.progress
        p.epochs[p.issued % p.RING] = ws.epoch
        p.issued += 1
        graph.launch(cuda._raw_stream(ws.device_index))

    gathered, outs = alloc()
    res = {"nodes": _graph_nodes(ws, a, b, outs, gathered)}
    del gathered, outs
    dist.barrier()
    times = host_us({"call": lambda: graph_op(a, *args), "alloc_launch": alloc_launch, "alloc": alloc,
                     "alloc_one_row": alloc_one_row,
                     "alloc_launch_in_turn": alloc_launch, "call_warm": lambda: graph_op(a, *args),
                     "alloc_launch_warm": alloc_launch, "alloc_warm": alloc}, rounds=rounds,
                    in_turn=frozenset({"alloc_launch_in_turn"}),
                    warm=frozenset({"call_warm", "alloc_launch_warm", "alloc_warm"}))
    res.update({f"{name}_us": v for name, v in times.items()})
    res["launch_us"] = times["alloc_launch"] - times["alloc"]
    res["launch_in_turn_us"] = times["alloc_launch_in_turn"] - times["alloc"]
    res["rest_us"] = times["call"] - times["alloc_launch"]
    res["launch_warm_us"] = times["alloc_launch_warm"] - times["alloc_warm"]
    res["rest_warm_us"] = times["call_warm"] - times["alloc_launch_warm"]
    res["not_replayed"] = len(missing)
    dist.barrier()
    res["phases_16"] = phases_of_16(lambda: graph_op(a, *args))
    return res


def measure(op: str, rows: int, k: int, n, rank: int, world: int, group_name: str, rounds: int,
            profile: bool = False, split: bool = False, schedule: str = "direct", parts: bool = False) -> dict:
    from compass_fx.cost import Topology, Workload
    from compass_fx.cost.strategies import fused_host_seconds
    from compass_fx.kernels.cuda import impl as cuda
    from compass_fx.kernels.cuda import replay
    from compass_fx.kernels.graph_order import graph_plans
    from compass_fx.kernels.issue_order import call_plans
    from compass_fx.kernels.protocol import host_most_pieces_setting, host_piece_bytes

    a, b = operands(op, rows, k, n, rank)
    through_op = getattr(torch.ops.compass, op)
    direct = getattr(cuda, op)
    args = (weights_arg(op, b), schedule, group_name, world)
    graph_op = through_op.graph

    def checked(name: str, fn) -> float:
        err = relative_error(op, fn(a, *args), rows, k, n, rank, world)
        if err > TOLERANCE:
            raise RuntimeError(f"{name} rows={rows}: result off by {err:.3g} of its largest element (rank {rank})")
        return err

    def replay_off(fn):  # fn with every command launched from Python, as before replays (COMPASS_FUSED_REPLAY=0)
        def issued_form(*call):
            os.environ["COMPASS_FUSED_REPLAY"] = "0"
            try:
                return fn(*call)
            finally:
                os.environ["COMPASS_FUSED_REPLAY"] = "1"
        return issued_form

    issued = replay_off(graph_op)

    try:
        from compass_fx.kernels.cuda import lane
    except ImportError:  # a package from before the host fast path (snapshot.py --scripts: an A/B's other turn)
        lane = None

    def python_path(*call):  # the .graph call with the C fast path set aside (.cuda.lane; an A/B in turns)
        if lane is None:
            return graph_op(*call)
        saved = lane.fast_calls[:]
        lane.fast_calls.clear()
        try:
            return graph_op(*call)
        finally:
            lane.fast_calls[:] = saved

    err = checked(op, through_op)
    for _ in range(2 * replay.PERIOD + 1):  # every residue of the epoch captured for these addresses
        graph_op(a, *args)
    # ops._direct's Python entry, the one the .graph overload had before C took its calls (lane.enter_from_c,
    # done when the process's first workspace built the fast path: read after the calls above): the A/B's
    # other side, behind it the same fast path (None where C does not take them)
    python_entry = getattr(graph_op._op, "fallback", None)
    # the C++ dispatcher's path to the same kernel: what a gather of several weights took while only one
    # weight counted as plain (ops._direct), and what the other calls took before they skipped it
    through_dispatcher = getattr(graph_op._op, "through_dispatcher", None)
    dist.barrier()
    before = dict(replay.stats)
    res = {"op": op, "world": world, "rows": rows, "k": k, "n": n, "relative_error": err,
           "replayed_relative_error": checked(f"{op}.graph replayed", graph_op),
           "issued_relative_error": checked(f"{op}.graph issued", issued),
           "python_path_relative_error": checked(f"{op}.graph, Python path", python_path),
           "fast_path": bool(lane and lane.fast_calls), "fast_path_off": lane and lane._state.get("failed")}
    timed = {"host_us_op": lambda: through_op(a, *args), "host_us_graph": lambda: graph_op(a, *args),
             "host_us_graph_busy": lambda: graph_op(a, *args), "host_us_graph_in_turn": lambda: graph_op(a, *args),
             "host_us_graph_warm": lambda: graph_op(a, *args), "host_us_graph_python": lambda: python_path(a, *args),
             "host_us_impl": lambda: direct(a, *args), "host_us_issued": lambda: issued(a, *args)}
    if python_entry is not None:
        timed["host_us_graph_python_entry"] = lambda: python_entry(a, *args)
    if through_dispatcher is not None:
        timed["host_us_graph_dispatcher"] = lambda: through_dispatcher(a, *args)
    if op != "all_gather_matmul":  # the asynchronous form: start, other work, wait (fused_async)
        # the overloads a rewritten graph and Inductor's wrapper call: the start's .default skips the dispatcher
        # (ops._skip_dispatcher), which its packet takes (runs before 2026-12-06)
        start = getattr(torch.ops.compass, f"{op}_start").default
        wait = torch.ops._c10d_functional.wait_tensor.default
        other = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)

        started = start_gemm_wait(start, wait, a, args, other)  # replayed on a stream of the workspace's own
        started_issued = replay_off(started)  # the same issued command by command, as before it replayed
        for name, form in (("async_relative_error", started), ("async_issued_relative_error", started_issued)):
            res[name] = max(relative_error(op, form(), rows, k, n, rank, world) for _ in range(5))
            if res[name] > TOLERANCE:
                raise RuntimeError(f"{op}_start rows={rows} ({name}): result off by {res[name]:.3g} (rank {rank})")
        timed["host_us_async"] = started
        timed["host_us_async_issued"] = started_issued
    # a plain eager op's issue in the same rounds, last (the forms above keep their order): the host's reference
    first_weight = weight_list(b)[0]
    timed["host_us_mm"] = lambda: torch.mm(a, first_weight)
    dist.barrier()
    # every rank runs the same sequence of calls: they are collective
    res.update(host_us(timed, rounds=rounds, busy=frozenset({"host_us_graph_busy"}),
                       in_turn=frozenset({"host_us_graph_in_turn"}), warm=frozenset({"host_us_graph_warm"})))
    dist.barrier()
    res.update(period_us(lambda: graph_op(a, *args)))
    dist.barrier()
    res.update(between_ops_us(lambda: graph_op(a, *args), lambda: step_ops(a)))
    # the same forms through the Python entry, then through the dispatcher, right after
    for suffix, entry in (("_python_entry", python_entry), ("_dispatcher", through_dispatcher)):
        if entry is None:
            continue
        dist.barrier()
        res.update({f"{k}{suffix}": v for k, v in period_us(lambda entry=entry: entry(a, *args)).items()
                    if k in ("host_us_first_of_16", "host_us_steady")})
        dist.barrier()
        res[f"host_us_between_ops{suffix}"] = between_ops_us(lambda entry=entry: entry(a, *args),
                                                             lambda: step_ops(a))["host_us_between_ops"]
    # a plain torch.mm of the case's operands back to back, after the forms above (their order as before it):
    # how much slower this host runs any eager op right after a wait
    dist.barrier()
    res.update({f"{k}_mm": v for k, v in period_us(lambda: torch.mm(a, first_weight)).items()
                if k in ("host_us_first_of_16", "host_us_steady")})
    if profile:  # where a replayed call's host time goes (cProfile's own overhead included)
        res["profile"] = python_profile(lambda: graph_op(a, *args))
        dist.barrier()
    if parts and op != "all_gather_matmul":  # where a deferred call's goes, in rounds of their own
        dist.barrier()
        res["deferred_parts"] = deferred_parts(start, wait, a, args, other, rounds, profile,
                                               packets=(getattr(torch.ops.compass, f"{op}_start"),
                                                        torch.ops._c10d_functional.wait_tensor))
        dist.barrier()
    if split:  # the same, without a profiler: forms timed in turns
        res["breakdown"] = breakdown(op, rows, k, n, world, group_name, a, b, rounds, schedule)
        dist.barrier()
    res["replayed_calls"] = replay.stats["replayed"] - before["replayed"]
    res["fast_path_calls"] = replay.stats.get("lane", 0) - before.get("lane", 0)
    res["captured_graphs"] = replay.stats["captured"] - before["captured"]
    res["device_launched_graphs"] = replay.stats["device_launched"] - before["device_launched"]
    dist.barrier()
    cols = k if op == "all_gather_matmul" else n
    matmuls = len(widths(n))
    host = os.environ["COMPASS_FUSED_TRANSPORT"] == "host"
    plans = call_plans(op, schedule, world, rank, rows, cols, matmuls, 2, host=host, piece_bytes=host_piece_bytes(),
                       most_pieces=host_most_pieces_setting())
    counts: dict[str, int] = {}
    for plan in plans:
        for c in plan.commands:
            counts[type(c).__name__] = counts.get(type(c).__name__, 0) + 1
    res["commands"] = counts
    res["plan_digest"] = plan_digest(plans + graph_plans(op, schedule, world, rank, rows, cols, matmuls, 2, host=host,
                                                         piece_bytes=host_piece_bytes(),
                                                         most_pieces=host_most_pieces_setting()))
    m = rows * world if op == "all_gather_matmul" else rows
    w = Workload(op, m, sum(widths(n)), k, "bfloat16", world, matmuls=matmuls, extra_n=widths(n)[1:])
    topo = Topology.preset("h200-host-staged-8" if host else "h200-nvswitch-8")
    res["model_us"] = fused_host_seconds(w, topo, schedule) * 1e6
    return res


SYNC_FLAGS = {"spin": 1, "yield": 2, "blocking": 4}  # CU_CTX_SCHED_*; "auto" (0) is CUDA's default


def set_sync(mode: str) -> dict:
    """Make this process's CUDA context wait for the device by ``mode`` (``SYNC_FLAGS``): spinning,
    yielding the core, or sleeping until the GPU wakes it.  Set on the primary context before torch
    creates it, through the driver (``cuDevicePrimaryCtxSetFlags``); returns the flags the context
    then has.  Why: the first call after a wait for the device runs slow on the host, and how the
    process waited is one thing that may decide how slow."""
    import ctypes

    if mode not in SYNC_FLAGS:
        raise ValueError(f"sync must be one of {sorted(SYNC_FLAGS)}, got {mode!r}")
    driver = ctypes.CDLL("libcuda.so.1")
    device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    for call, args in (("cuInit", (0,)), ("cuDeviceGet", (ctypes.byref(device), 0)),
                       ("cuDevicePrimaryCtxSetFlags", (device, SYNC_FLAGS[mode])),
                       ("cuDevicePrimaryCtxGetState", (device, ctypes.byref(flags), ctypes.byref(active)))):
        rc = getattr(driver, call)(*args)
        if rc:
            raise RuntimeError(f"{call} failed with CUDA error {rc} (setting the context's sync to {mode!r})")
    if flags.value & 7 != SYNC_FLAGS[mode]:
        raise RuntimeError(f"the primary context's flags are {flags.value:#x} after asking for {mode!r}")
    return {"mode": mode, "flags": flags.value}


def worker(rank: int, world: int, init: str, out_path: str, profile: bool, split: bool = False,
           pinned: bool = False, carveout: int = 0, transport: str = "host", cases: list | None = None,
           schedule: str = "direct", sync: str = "auto", parts: bool = False) -> None:
    cpus = pin(rank) if pinned else []
    synced = set_sync(sync) if sync in SYNC_FLAGS else None  # before torch makes the context
    _POLLING[0] = sync == "poll"
    if carveout:  # cuBLAS leaves this many SMs to other work (the replay graphs' wait kernels)
        torch._C._set_sm_carveout_experimental(carveout)
    # the peers share one GPU: they meet in pinned host memory, or (peer) map each other's buffers of
    # that GPU with CUDA IPC, as the peer transport does on an NVLink machine with symmetric memory
    os.environ["COMPASS_FUSED_TRANSPORT"] = transport
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import compass_fx.kernels  # noqa: F401  (registers torch.ops.compass)

    payload = {"launch_us": launch_costs(), "rows": [], "cpus": cpus, "sync": synced}
    for case in cases or CASES:
        row = measure(*case, rank, world, dist.group.WORLD.group_name, 15 if world == 2 else 9,
                      profile and case in (CASES[0], CASES[4]), split, schedule, parts)
        payload["rows"].append(row)
        if rank == 0:
            print(f"world {world} {row['op']} rows={row['rows']}: {row['host_us_graph']:.0f} us per call through "
                  f"the .graph overload ({row['host_us_issued']:.0f} issued command by command, "
                  f"{row['host_us_op']:.0f} through the op, {row['host_us_impl']:.0f} without dispatch), model "
                  f"{row['model_us']:.0f} us, commands {sum(row['commands'].values())}, replayed "
                  f"{row['replayed_calls']}", flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(payload, f)
    dist.barrier()
    dist.destroy_process_group()


def markdown(payload: dict) -> str:
    lines = [f"# {NAME} ({payload['tag']})", "",
             "Host microseconds of one fused call (ranks sharing one GPU, "
             + ("peer transport: each other's buffers of the GPU mapped with CUDA IPC, device-to-device copies"
                if payload.get("transport") == "peer" else "host-staged transport") + ", schedule "
             + payload.get("schedule", "direct") + ", bf16); median of 15 rounds (9 beyond two ranks) of 4 calls issued after the device went "
             "idle, the forms of a case taking turns within each round. op: through the custom op; .graph: "
             "the overload rewritten graphs call (replayed from a captured CUDA graph once its addresses "
             "recur; issued from C by the host fast path, compass_fx/kernels/cuda/lane.cpp, once its graph "
             "exists; the overload's eager calls entered from C, .cuda.lane.enter_from_c); .graph, Python entry: "
             "the same through the overload's Python entry (ops._direct's, as before C took its calls; its first of "
             "16, steady and between-ops forms measured right after the C entry's); .graph, Python path: the same "
             "with the fast path set aside (as before it); .graph, dispatcher: the same through the C++ dispatcher (the "
             "path a gather of several weights took while only one weight counted as plain: its Python kernel, then "
             "C; its steady and between-ops forms after the Python entry's); n: the weights' widths (a gather of "
             "several: Q, K and V, or w1 and w3, sharing their gathered rows); issued: the same with COMPASS_FUSED_REPLAY=0 (every "
             "command launched from Python, as before); impl: the implementation called directly; start, wait: the asynchronous form "
             "(fused_async's: start, a 2048-square GEMM, wait_tensor; replayed on a stream of its own; issued: "
             "with COMPASS_FUSED_REPLAY=0, as before it replayed); .graph, GPU busy: the .graph calls issued while the GPU sleeps 2 ms first "
             "(the host runs ahead of a busy device, as in a step; the other forms start from an idle one); "
             ".graph, warm host: the same after the host spun 3 ms, the GPU busy (a host that just waited ~10 ms for "
             "the GPU runs slower for a while, and each form of a large case follows such a wait); "
             ".graph, 16 back to back: the host's time per call while it issues the period's 16 calls one after "
             "another (as a step issues them): on average, the first call (right after the wait for the device) "
             "and the median of the other 15 (steady: each issued while the calls before it run); "
             ".graph, between a step's ops: 16 calls each after an RMSNorm and a SiLU-gated product of the "
             "call's activations issued eagerly (nine kernels, the host not waiting), the call alone timed, "
             "median of all but the first (as a sequence-parallel block issues its pairs); "
             ".graph, ranks in turn: the same issued by one rank at a time while the others wait at a barrier "
             "(no other process launches at that moment, as where each rank has a GPU of its own); "
             "torch.mm: a plain torch.mm of the case's operands in the same rounds (four calls after idle), and "
             "its first of 16 back to back and steady ones (a plain eager op's issue on this host, cold and hot); "
             "period: 16 .graph calls back to back from an idle device to the end of the last, per call (every "
             "rank's work shares the GPU: it compares ways of launching, it is no device time of one rank); "
             "host / GPU per rank: .graph host time over period / world, the GPU's time per call and rank "
             "where each rank has a GPU of its own (below 1: the host issues a call faster than the GPU "
             "runs it, so the host does not set the pace).", ""]
    if payload.get("replay_waits"):
        lines += [f"Replay graphs' flag waits: `{payload['replay_waits']}` (COMPASS_REPLAY_WAITS).", ""]
    settings = payload.get("settings")
    if settings:
        lines += ["Settings: " + ", ".join(f"`{k}={v}`" for k, v in sorted(settings.items())) + "; replay graphs "
                  f"launched by the GPU: {sum(r.get('device_launched_graphs', 0) for r in payload['rows'])} of "
                  f"{sum(r.get('captured_graphs', 0) for r in payload['rows'])} captured (rank 0).", ""]
    for world, cpus in payload.get("rank0_cpus", {}).items():
        if cpus:
            lines += [f"World {world}: each rank pinned to a physical core of its own (`--pin`; rank 0 on CPUs "
                      f"{cpus}).", ""]
    for world, launch in payload["launch_us"].items():
        lines += [f"Launch alone, world {world} (us): " + ", ".join(f"{k} {v:.1f}" for k, v in launch.items()), ""]
    lines.append(output.markdown_table(
        [dict(r, n="+".join(str(width) for width in widths(r["n"])), n_commands=sum(r["commands"].values()),
              model_over_graph=r["model_us"] / r["host_us_graph"],
              host_share=r["host_us_graph"] / (r["period_us"] / r["world"]) if r.get("period_us") else None)
         for r in payload["rows"]],
        ["world", "op", "rows", "k", "n", ("n_commands", "commands"), ("host_us_op", "host us (op)"),
         ("host_us_graph", "host us (.graph)"), ("host_us_graph_python_entry", "host us (.graph, Python entry)"),
         ("host_us_graph_python", "host us (.graph, Python path)"),
         ("host_us_graph_dispatcher", "host us (.graph, dispatcher)"),
         ("host_us_graph_busy", "host us (.graph, GPU busy)"),
         ("host_us_graph_warm", "host us (.graph, warm host)"),
         ("host_us_back_to_back", "host us (.graph, 16 back to back)"),
         ("host_us_first_of_16", "host us (.graph, first of 16)"),
         ("host_us_first_of_16_python_entry", "host us (.graph, first of 16, Python entry)"),
         ("host_us_steady", "host us (.graph, steady)"),
         ("host_us_steady_python_entry", "host us (.graph, steady, Python entry)"),
         ("host_us_steady_dispatcher", "host us (.graph, steady, dispatcher)"),
         ("host_us_between_ops", "host us (.graph, between a step's ops)"),
         ("host_us_between_ops_python_entry", "host us (.graph, between a step's ops, Python entry)"),
         ("host_us_between_ops_dispatcher", "host us (.graph, between a step's ops, dispatcher)"),
         ("host_us_graph_in_turn", "host us (.graph, ranks in turn)"),
         ("host_us_mm", "host us (torch.mm)"), ("host_us_first_of_16_mm", "host us (torch.mm, first of 16)"),
         ("host_us_steady_mm", "host us (torch.mm, steady)"),
         ("host_us_issued", "host us (issued)"),
         ("host_us_impl", "host us (impl)"), ("host_us_async", "host us (start, wait)"),
         ("host_us_async_issued", "host us (start, wait; issued)"),
         ("period_us", "period us (16 .graph in a row)"), ("host_share", "host / GPU per rank"),
         ("replayed_calls", "replayed calls"), ("fast_path_calls", "of which from C"), ("model_us", "model us"), ("model_over_graph", "model / .graph")]))
    lines += ["", *goal_lines(payload["rows"]), *entry_lines(payload["rows"]),
              *entry_lines(payload["rows"], "_dispatcher", "the dispatcher"), *mm_lines(payload["rows"])]
    split = [dict(r["breakdown"], world=r["world"], op=r["op"], rows=r["rows"],
                  nodes=", ".join(f"{k} {v}" for k, v in sorted(r["breakdown"]["nodes"].items())))
             for r in payload["rows"] if "call_us" in r.get("breakdown", {})]
    phased = [dict(world=r["world"], op=r["op"], rows=r["rows"], first_us=r.get("host_us_first_of_16"),
                   steady_us=r.get("host_us_steady"), first=_phase_text(r["breakdown"]["phases_16"]["first"]),
                   steady=_phase_text(r["breakdown"]["phases_16"]["steady"]))
              for r in payload["rows"] if r.get("breakdown", {}).get("phases_16")]
    if phased:
        lines += ["", "The first of 16 back-to-back .graph calls (right after the wait for the device) and the "
                  "steady ones (median of the other 15): their host time as the period's rounds measured it and, in "
                  "rounds of their own, read from the fast path's clock (`lane.last_phases`, microseconds, median over "
                  "rounds), where it went in C: checks (settings, "
                  "key, workspace lookup), outputs (allocations), prepare (the graph found, the watchdog's room), "
                  "launch (cuGraphLaunch), bookkeeping (epoch, stats, ring), and outside C: the host time of those "
                  "same calls less these (the op's wrapper in Python, the return):", "",
                  output.markdown_table(phased, ["world", "op", "rows", ("first_us", "first of 16 us"),
                                                 ("first", "first, in C"), ("steady_us", "steady us"),
                                                 ("steady", "steady, in C")])]
    deferred = [dict(r["deferred_parts"], world=r["world"], op=r["op"], rows=r["rows"])
                for r in payload["rows"] if r.get("deferred_parts")]
    if deferred:
        lines += ["", "Where a deferred call's host microseconds go (`--deferred-parts`: forms timed in turns, no "
                  "profiler, after the case's other forms; whole: start, a 2048-square GEMM, wait_tensor; its phases "
                  "read by the clock inside each call, median over every call; events: the four driver calls ordering "
                  "a replayed deferred call's stream with the caller's and its join's wait, without the graph; "
                  "hand-off: a c10d work registered for a tensor and taken back by wait_tensor, its join waiting "
                  "for nothing; packets: the whole call through the ops' packets and the dispatcher, as the "
                  "asynchronous form's runs before 2026-12-06 called them; the others call the .default overloads, "
                  "as rewritten graphs do):", "",
                  output.markdown_table(deferred, ["world", "op", "rows", ("host_us_start_gemm_wait", "whole us"),
                                                   ("host_us_phase_start", "start us"),
                                                   ("host_us_phase_gemm", "GEMM us"),
                                                   ("host_us_phase_wait", "wait us"),
                                                   ("host_us_start_wait", "start + wait us, no GEMM"),
                                                   ("host_us_gemm", "GEMM alone us"),
                                                   ("host_us_events", "events us"),
                                                   ("host_us_register_wait", "hand-off us"),
                                                   ("host_us_start_gemm_wait_packets", "whole us, packets")])]
    if split:
        lines += ["", "Where a replayed call's host microseconds go (`--breakdown`: forms timed in turns, no profiler; "
                  "launch = outputs allocated + epoch raised + graph launched, less the allocations alone; rest = "
                  "the call less that: checks, key, workspace lookup, replay bookkeeping; outputs, one row each: as many "
                  "allocations of one row; warm: the same forms "
                  "issued after the host spun WARM_S, the GPU busy):", "",
                  output.markdown_table(split, ["world", "op", "rows", ("call_us", "call us"),
                                                ("launch_us", "cuGraphLaunch us"),
                                                ("launch_in_turn_us", "cuGraphLaunch us, ranks in turn"),
                                                ("alloc_us", "outputs us"),
                                                ("alloc_one_row_us", "outputs us, one row each"),
                                                ("rest_us", "rest us"), ("call_warm_us", "call us, warm"),
                                                ("launch_warm_us", "cuGraphLaunch us, warm"),
                                                ("alloc_warm_us", "outputs us, warm"), ("rest_warm_us", "rest us, warm"),
                                                ("nodes", "replay graph nodes")])]
    return "\n".join(lines)


GOAL_US = {2: 60.0}  # issue 27: one eager fused call's host time, two ranks; 150 us at four and eight


def goal_us(world: int) -> float:
    """Issue 27's goal for one eager fused call's host time with ``world`` ranks sharing the GPU."""
    return GOAL_US.get(world, 150.0)


GOAL_FORMS = (("host_us_graph", ".graph"), ("host_us_back_to_back", "16 back to back"), ("host_us_steady", "steady"),
              ("host_us_between_ops", "between a step's ops"))


ENTRY_FORMS = (("host_us_graph", ".graph"), ("host_us_first_of_16", "first of 16"), ("host_us_steady", "steady"),
               ("host_us_between_ops", "between a step's ops"))


def entry_lines(rows: list[dict], other: str = "_python_entry", name: str = "the Python entry") -> list[str]:
    """Per world, the .graph overload's C entry against its Python entry (the A/B of
    ``lane.enter_from_c``, both in one run; ``other`` ``_dispatcher``: against the C++ dispatcher's path):
    each form's host time through C over that through the other path, its range over the rows and the
    median of the microseconds saved."""
    lines = []
    for world in sorted({r["world"] for r in rows}):
        parts = []
        for key, label in ENTRY_FORMS:
            pairs = [(r[key], r[f"{key}{other}"]) for r in rows
                     if r["world"] == world and r.get(key) is not None and r.get(f"{key}{other}") is not None]
            if pairs:
                ratios = [c / p for c, p in pairs]
                saved = statistics.median(p - c for c, p in pairs)
                parts.append(f"{label} {min(ratios):.2f}-{max(ratios):.2f}x (median {saved:.1f} us less)")
        if parts:
            lines.append(f"C entry over {name} at world {world} (host time, row by row): " + "; ".join(parts) + ".")
    return lines


MM_FORMS = (("host_us_mm", "four calls after the device went idle"), ("host_us_first_of_16_mm", "first of 16"),
            ("host_us_steady_mm", "steady"))


def mm_lines(rows: list[dict]) -> list[str]:
    """Per world, a plain ``torch.mm`` of each case's operands timed in the same rounds as the .graph
    call (four calls after the device went idle, then the first of 16 back to back and the steady
    ones): its host time, and the first call's slowness after a wait (first of 16 over steady) for
    the fused call and for ``torch.mm``, row by row.  Why: the first call after a wait is slow in
    every phase, plain host code included (``cold_host_probe``); a plain op measured beside it says
    how much of that the host makes any eager op pay, so a reader can tell the call's own cost from
    the host's."""
    lines = []
    for world in sorted({r["world"] for r in rows}):
        mine = [r for r in rows if r["world"] == world and r.get("host_us_steady_mm") is not None]
        if not mine:
            continue
        parts = []
        for key, label in MM_FORMS:
            got = [r[key] for r in mine if r.get(key) is not None]
            if got:
                parts.append(f"{label} {min(got):.1f}-{max(got):.1f} us")
        cold = [(r["host_us_first_of_16"] / r["host_us_steady"], r["host_us_first_of_16_mm"] / r["host_us_steady_mm"])
                for r in mine if r.get("host_us_first_of_16") and r.get("host_us_steady")
                and r.get("host_us_first_of_16_mm") and r["host_us_steady_mm"]]
        said = (f"; first of 16 over steady: the .graph call {min(c for c, _ in cold):.1f}-{max(c for c, _ in cold):.1f}x,"
                f" torch.mm {min(m for _, m in cold):.1f}-{max(m for _, m in cold):.1f}x") if cold else ""
        lines += [f"A plain torch.mm of the case's operands in the same rounds at world {world}: " + ", ".join(parts)
                  + said + ".", ""]
    return lines


def goal_lines(rows: list[dict]) -> list[str]:
    """Per world, where the host-time goal stands: each form's range and how many rows are within
    the goal (60 us at two ranks, 150 beyond); for the rows over it, whether the host would set
    their pace (their .graph host time over the GPU's time per call and rank, where measured)."""
    lines = []
    for world in sorted({r["world"] for r in rows}):
        goal = goal_us(world)
        parts = []
        for key, label in GOAL_FORMS:
            got = [r[key] for r in rows if r["world"] == world and r.get(key) is not None]
            if got:
                parts.append(f"{label} {min(got):.0f}-{max(got):.0f} us, {sum(v <= goal for v in got)} of "
                             f"{len(got)} rows within")
        over = [r["host_us_graph"] / (r["period_us"] / world) for r in rows
                if r["world"] == world and r.get("host_us_graph", 0) > goal and r.get("period_us")]
        if parts:
            share = (f" (.graph over the goal: host / GPU per rank {min(over):.2f}-{max(over):.2f}, "
                     f"{'below' if max(over) < 1 else 'not all below'} 1)") if over else ""
            lines += [f"Goal at world {world} (<= {goal:.0f} us): " + "; ".join(parts) + share + ".", ""]
    return lines


def plan_digest(plans) -> str:
    """A fingerprint of a case's plans, commands in order (the eager call's and its replay graph's):
    runs of two packages tell apart the cases whose plans changed (``host_time_ab.py``), order
    alone included, which the commands by kind do not show."""
    import hashlib

    return hashlib.sha1(repr(tuple(plan.commands for plan in plans)).encode()).hexdigest()[:12]


def selected_cases(ops: str, case_set: str = "default") -> list:
    """The cases of ``case_set`` (:data:`CASE_SETS`) of the operators named in ``ops`` (comma-separated;
    empty: every case of the set)."""
    cases = CASE_SETS[case_set]
    if not ops:
        return list(cases)
    wanted = [op.strip() for op in ops.split(",") if op.strip()]
    known = sorted({case[0] for case in cases})
    unknown = [op for op in wanted if op not in known]
    if unknown:
        raise SystemExit(f"--ops: unknown operator(s) {unknown}; the cases' operators are {known}")
    return [case for case in cases if case[0] in wanted]


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2", help="ranks sharing the GPU, one run per world (e.g. 2,4,8)")
    p.add_argument("--profile", action="store_true", help="cProfile the replayed calls of two cases per world")
    p.add_argument("--breakdown", action="store_true",
                   help="time a replayed call's launch, allocations and the rest apart, in turns (every case)")
    p.add_argument("--deferred-parts", action="store_true",
                   help="time a deferred call's parts apart, in turns: start + wait without the GEMM, the GEMM, "
                   "the events ordering its stream, c10d's hand-off (the reducing operators' cases)")
    p.add_argument("--pin", action="store_true",
                   help="pin each rank to a physical core of its own (no rank shares a core with another)")
    p.add_argument("--transport", choices=("host", "peer"), default="host",
                   help="how the ranks meet: pinned host memory (default) or each other's GPU buffers (CUDA IPC)")
    p.add_argument("--carveout", type=int, default=0,
                   help="SMs every rank's cuBLAS GEMMs leave free (torch._C._set_sm_carveout_experimental)")
    from compass_fx.kernels.schedules import SCHEDULES

    p.add_argument("--schedule", choices=SCHEDULES, default="direct",
                   help="the fused calls' schedule (the host-staged transport runs only 'direct' in rewritten graphs)")
    p.add_argument("--sync", choices=("auto", *SYNC_FLAGS, "poll"), default="auto",
                   help="how each rank's CUDA context waits for the device (CU_CTX_SCHED_*; default: CUDA's auto); "
                   "poll: the timing loops first poll the stream in a busy loop (wait_for_device)")
    p.add_argument("--ops", default="",
                   help="only these operators' cases, comma-separated (e.g. all_gather_matmul); default: all")
    p.add_argument("--cases", choices=sorted(CASE_SETS), default="default",
                   help="default: one weight a call, llama3-8b widths at 512-8192 tokens; weights: gathers of "
                   "several weights (Q, K, V; w1, w3) as a sequence-parallel block makes them")
    p.add_argument("--tag", default="h200")
    p.add_argument("--out-dir", default=str(output.RESULTS))
    args = p.parse_args(argv)
    cases = selected_cases(args.ops, args.cases)
    if args.transport == "host" and args.schedule != "direct":
        p.error("--schedule: the host-staged transport runs only 'direct' in rewritten graphs (cost.select); "
                "measure the others with --transport peer")
    if not torch.cuda.is_available():
        raise SystemExit("fused_host_time needs a CUDA GPU (the host time measured is the CUDA path's)")
    payload = {"launch_us": {}, "rows": [], "benchmark": NAME, "tag": args.tag,
               "settings": {k: v for k, v in os.environ.items() if k.startswith(("COMPASS_", "CUDA_MPS_"))}}
    if args.carveout:
        payload["settings"]["sm_carveout"] = args.carveout
    payload["transport"] = args.transport
    payload["schedule"] = args.schedule
    if args.ops:
        payload["ops"] = args.ops
    if args.cases != "default":
        payload["cases"] = args.cases
    if args.sync != "auto":
        payload["settings"]["sync"] = args.sync
    from compass_fx.kernels.cuda import replay

    payload["replay_waits"] = replay.wait_mode()  # how replay graphs waited (the fit counts their nodes so)
    from compass_fx.kernels.protocol import host_most_pieces, host_most_pieces_setting

    payload["host_most_pieces"] = host_most_pieces_setting()  # 0: by the ranks
    payload["host_most_pieces_by_world"] = {w: host_most_pieces(int(w), payload["host_most_pieces"])
                                            for w in args.worlds.split(",")}  # what the fit cuts blocks to
    t0 = time.time()
    for world in (int(w) for w in args.worlds.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            mp.spawn(worker, args=(world, f"file://{os.path.join(tmp, 'store')}", out, args.profile, args.breakdown,
                                   args.pin, args.carveout, args.transport, cases, args.schedule, args.sync,
                                   args.deferred_parts),
                     nprocs=world)
            got = json.load(open(out))
        payload["launch_us"][world] = got["launch_us"]
        payload.setdefault("rank0_cpus", {})[world] = got["cpus"]
        if got.get("sync"):
            payload.setdefault("rank0_sync", {})[world] = got["sync"]
        payload["rows"] += got["rows"]
        payload.update(seconds=time.time() - t0, environment=output.environment(False))
        output.write_results(NAME, args.tag, payload, markdown(payload), args.out_dir)  # what is done so far
    print(markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
