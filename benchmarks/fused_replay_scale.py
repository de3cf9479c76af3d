"""Eager fused calls at a deep model's scale, on ONE GPU: how many of a step's calls replay, what
the replay graphs keep in GPU memory, and the host's time per call, as the layers grow.

Why (issue 27): a replayed call costs the host tens of microseconds, one issued from Python
hundreds.  Replays are kept per set of a call's addresses (:mod:`compass_fx.kernels.cuda.replay`),
and every layer's call of one operator and shape is a set of its own (its weight, its input, its
output), so a workspace holds as many sets as the model has layers (twice that with activation
checkpointing, whose recomputed forward has inputs of its own).  What the tests at two layers never
showed: how many sets the limit holds against 80 or 126 layers, and what each set costs the GPU's
memory (a graph's private pool keeps whatever its capture allocated).

W ranks (processes in a gloo group) share one GPU and meet in pinned host memory (``--transport
peer``: each other's buffers of it, through CUDA IPC), as ``fused_host_stress`` does.  A case is
one operator at one depth L: L layers, each with its own weight and input (seeded per layer and
rank); a step calls the ``.graph`` overload (what rewritten graphs call) once per layer, keeping
the outputs until the step ends, as a forward keeps its activations.  ``--steps`` steps, the last
two measured: the calls replayed and issued from C (the host fast path), the host's time per call,
and, after the case's tensors are freed, the GPU memory its replay graphs and workspace keep
(torch's pools, this rank; and, device-wide, the driver's own, all ranks).  Per step, the graphs
captured and the calls issued from C, and from which step on every call was (a call site's graphs
are one per residue of its epoch mod 4: at a depth that is not a multiple of 4 a site's epoch
moves from step to step, and each residue is captured on its first call; an output's address is
part of the key too, so where the allocator hands a layer another address than the step before,
that is a set of its own: both are recorded).  The last step's
outputs of every layer are checked against a reference from every rank's inputs.  Each case has
rows of its own size (1024 + 16 x its index), so it gets workspaces of its own and earlier cases'
graphs stay out of its memory figures.

    python benchmarks/fused_replay_scale.py --worlds 2,4,8 --tag h200-mps     # depths 2-128, 61 and 126 among them
"""
from __future__ import annotations

import gc
import os
import statistics
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import launch, output  # noqa: E402  (sets the no-multicast environment first)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import fused_host_stress as stress  # noqa: E402  (a layer's operands and reference, as a stress case's)
from compass_fx import fused_calls  # noqa: E402

NAME = "fused_replay_scale"
TOL = 2e-2  # of the largest element: bf16 products summed in another order than the reference
KINDS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
K, N = 1024, 2048  # every layer's weight: K x N (bf16)
MEASURED = 2  # the last steps, whose calls are counted and timed
MIB = 1 << 20


def held() -> tuple[int, int]:
    """Replay graphs (a set keeps one per epoch residue) and sets of addresses every workspace of this
    process holds."""
    workspaces = fused_calls().workspaces
    return sum(w.graphs for w in workspaces), sum(w.sets for w in workspaces)


def settled_step(from_c: list[int], layers: int) -> int | None:
    """The first step (counted from 1) from which every step issued all its calls from C, or None."""
    settled = None
    for step, count in enumerate(from_c, start=1):
        if count < layers:
            settled = None
        elif settled is None:
            settled = step
    return settled


def same_share(addresses: list[list[int]], back: int) -> float | None:
    """The share of the last step's outputs at the address the same layer's had ``back`` steps before
    (an output's address is part of its replay set's key)."""
    if len(addresses) <= back:
        return None
    last, then = addresses[-1], addresses[-1 - back]
    return sum(x == y for x, y in zip(last, then)) / len(last)


def run_case(rank: int, world: int, kind: str, layers: int, rows: int, steps: int) -> dict:
    """One operator at one depth on this rank (see the module's docstring)."""
    group = dist.group.WORLD.group_name
    packet = getattr(torch.ops.compass, kind).graph
    if kind == "all_gather_matmul":
        def call(a, b):
            return packet(a, [b], "direct", group, world)[1][0]
    else:
        def call(a, b):
            return packet(a, b, "direct", group, world)
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    reserved0, (graphs0, sets0) = torch.cuda.memory_reserved(), held()
    operands = [stress.operands(kind, rows, N, K, world, rank, layer) for layer in range(layers)]  # seeded by layer
    host_us = []
    outs: list[torch.Tensor] = []
    # per step: graphs captured, calls replayed and issued from C, the outputs' addresses
    captures, replayed, from_c, addresses = [], [], [], []
    step_spans = []  # measured steps: (host seconds, GPU start event, GPU end event)
    for step in range(steps):
        measured = step >= steps - MEASURED
        before = fused_calls()
        outs = []
        t_step = time.perf_counter()
        if measured:  # the GPU's span of the step, on the caller's stream
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        for a, b in operands:
            t0 = time.perf_counter()
            outs.append(call(a, b))
            if measured:
                host_us.append((time.perf_counter() - t0) * 1e6)
        if measured:
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()
            step_spans.append((time.perf_counter() - t_step, started, ended))
        addresses.append([out.data_ptr() for out in outs])
        if step < steps - 1:
            del outs
        else:  # how far the GPU is behind once the host has issued the last step
            issued = time.perf_counter()
            torch.cuda.synchronize()
            behind_ms = (time.perf_counter() - issued) * 1e3
        own = fused_calls().since(before)  # the step's own calls, as a user reads them
        captures.append(own.captured)
        replayed.append(own.replayed)
        from_c.append(own.from_c)
        dist.barrier()  # the ranks' steps in lockstep, as a model's
    host_ms = statistics.median(span[0] * 1e3 for span in step_spans)
    gpu_ms = statistics.median(span[1].elapsed_time(span[2]) for span in step_spans)
    worst = 0.0
    for layer, out in enumerate(outs):
        want = stress.reference(kind, rows, N, K, world, rank, layer)[0]
        worst = max(worst, float((out.float() - want).abs().max() / want.abs().max()))
    del outs, operands
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    graphs1, sets1 = held()
    graphs, sets = graphs1 - graphs0, sets1 - sets0
    kept = torch.cuda.memory_reserved() - reserved0
    host_us.sort()
    return {"status": "pass" if worst < TOL else "FAIL", "relative_error": worst,
            "replayed": sum(replayed[-MEASURED:]) / (MEASURED * layers),
            "from_c": sum(from_c[-MEASURED:]) / (MEASURED * layers),
            "host_us_median": statistics.median(host_us), "host_us_p90": host_us[int(0.9 * (len(host_us) - 1))],
            "graphs": graphs, "sets": sets, "torch_kept_mib": kept / MIB,
            "host_ms_per_step": host_ms, "gpu_ms_per_step": gpu_ms, "gpu_behind_ms": behind_ms,
            "captures_by_step": captures, "from_c_by_step": from_c,
            "settled_step": settled_step(from_c, layers),
            "same_outputs_as_step_before": same_share(addresses, 1),
            "same_outputs_as_two_steps_before": same_share(addresses, 2)}


def worker(rank: int, world: int, todo: list[dict], steps: int, transport: str, init: str, out_path: str) -> None:
    """Every case of this world, one after another; device-wide memory read on rank 0 between them."""
    os.environ["COMPASS_FUSED_TRANSPORT"] = transport
    os.environ["COMPASS_FUSED_TIMEOUT_S"] = "30"
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import compass_fx.kernels  # noqa: F401  (registers torch.ops.compass)

    results = []
    for case in todo:
        dist.barrier()
        free0 = torch.cuda.mem_get_info()[0]
        try:
            res = run_case(rank, world, case["kind"], case["layers"], case["rows"], steps)
        except Exception as e:  # noqa: BLE001 - the case's outcome (a watchdog error names op, rank, piece)
            res = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-800:]}
        dist.barrier()
        res["device_kept_mib"] = (free0 - torch.cuda.mem_get_info()[0]) / MIB  # every rank's, and the driver's
        results.append(res)
        if not launch.save_and_agree(results, out_path, rank):  # every rank goes on to the next case, or none
            break
    launch.leave_group()


def cases(kinds: list[str], depths: list[int]) -> list[dict]:
    """Each operator at each depth, with rows of its own size (its own workspaces)."""
    return [dict(kind=kind, layers=layers, rows=1024 + 16 * i)
            for i, (kind, layers) in enumerate((k, d) for k in kinds for d in depths)]


def latest(steps) -> int | None:
    """The last of the ranks' settled steps (None where a rank never settled)."""
    steps = list(steps)
    return None if None in steps else max(steps)


def world_rows(world: int, todo: list[dict], steps: int, transport: str, tmp: str, deadline_s: float) -> list[dict]:
    """The cases of one world in one set of fresh processes; a row per case, with every rank's figures."""
    ranks, killed = launch.fresh_ranks(worker, world, (todo, steps, transport), tmp, world, deadline_s)
    per_rank = [r if isinstance(r, list) else [r] for r in ranks]
    rows = []
    for i, case in enumerate(todo):
        got = [r[i] if i < len(r) else {"status": "error", "error": "rank stopped before this case"}
               for r in per_rank]
        statuses = {r["status"] for r in got}
        row = dict(case, world=world, transport=transport,
                   status="pass" if statuses == {"pass"} else "FAIL" if "FAIL" in statuses else "error")
        if row["status"] == "pass":
            graphs = sum(r["graphs"] for r in got)
            torch_kept = sum(r["torch_kept_mib"] for r in got)
            row.update(relative_error=max(r["relative_error"] for r in got),
                       replayed=min(r["replayed"] for r in got), from_c=min(r["from_c"] for r in got),
                       host_us_median=statistics.median(r["host_us_median"] for r in got),
                       host_us_p90=max(r["host_us_p90"] for r in got),
                       host_ms_per_step=statistics.median(r["host_ms_per_step"] for r in got),
                       gpu_ms_per_step=statistics.median(r["gpu_ms_per_step"] for r in got),
                       gpu_behind_ms=max(r["gpu_behind_ms"] for r in got),
                       graphs=graphs, sets=sum(r["sets"] for r in got),
                       sets_per_layer=sum(r["sets"] for r in got) / (world * case["layers"]),
                       settled_step=latest(r["settled_step"] for r in got),
                       captures_by_step=[sum(steps) for steps in zip(*(r["captures_by_step"] for r in got))],
                       from_c_by_step=[min(steps) for steps in zip(*(r["from_c_by_step"] for r in got))],
                       same_outputs_as_step_before=min(r["same_outputs_as_step_before"] for r in got),
                       same_outputs_as_two_steps_before=min(r["same_outputs_as_two_steps_before"] for r in got),
                       torch_kept_mib=torch_kept, device_kept_mib=got[0]["device_kept_mib"],
                       torch_mib_per_graph=torch_kept / graphs if graphs else None,
                       driver_mib_per_graph=(got[0]["device_kept_mib"] - torch_kept) / graphs if graphs else None)
        errors = [r["error"] for r in got if "error" in r]
        if errors:
            row["error"] = errors[0][:300]
        if killed:
            row["killed_ranks"] = killed
        rows.append(row)
        print(f"world {world} {case['kind']} L={case['layers']}: {row['status']} replayed {row.get('replayed')} "
              f"graphs {row.get('graphs')} kept {row.get('torch_kept_mib')} MiB (device {row.get('device_kept_mib')})",
              flush=True)
    return rows


def markdown(payload: dict) -> str:
    lines = [f"# {NAME} ({payload['tag']})", "",
             f"{'Peer transport (CUDA IPC)' if payload['transport'] == 'peer' else 'Host-staged transport'}, "
             f"ranks sharing one GPU; a case is one operator at depth L (L layers, each with its weight of "
             f"{K}x{N} and its input), a step one `.graph` call per layer, outputs kept to the step's end; "
             f"{payload['steps']} steps, the last {MEASURED} measured. replayed, from C: the fewest over the ranks "
             "of the measured calls served from replay graphs, and issued by the host fast path; host us: the "
             "median over ranks of each rank's median per call, and the largest 90th percentile; graphs: replay "
             "graphs the case left, every rank's; kept MiB: GPU memory the case left once its tensors were freed "
             "(torch: the ranks' pools, the graphs' private pools and the workspaces' buffers; device: the "
             "GPU's, the driver's own as well), and per graph. sets / layer: the sets of addresses the "
             "workspaces keep graphs for, over the calls of a step (every rank's); settled: the first step from "
             "which every call of every rank was issued from C; same outputs: the share of the last step's "
             "outputs at the address the same layer's had one and two steps before (the fewest over the ranks); "
             "captures: graphs captured in each step, every rank's; host / GPU ms per step: the median over ranks of "
             "a measured step's time on the host (issuing its calls) and on the GPU (the caller's stream, from the "
             "step's first call to its last); GPU behind: how long the GPU took to finish the last step once its "
             "host had issued it (the most over the ranks). A GPU far behind, with the host's step as long as the "
             "GPU's, means the host waited for a full launch queue: its time per call is the GPU's pace, not its own "
             "work; a GPU not behind means the host set the pace. Replay sets a workspace keeps: "
             f"`COMPASS_FUSED_REPLAY_GRAPHS` = {payload.get('replay_limit')}.", ""]
    if payload.get("note"):
        lines[1:1] = [f"Note: {payload['note']}", ""]
    lines.append(output.markdown_table(payload["rows"], [
        "world", "kind", "layers", "rows", "status", ("relative_error", "rel. error"), "replayed", ("from_c", "from C"),
        ("host_us_median", "host us"), ("host_us_p90", "host us p90"), ("host_ms_per_step", "host ms / step"),
        ("gpu_ms_per_step", "GPU ms / step"), ("gpu_behind_ms", "GPU behind ms"), "graphs", ("sets_per_layer", "sets / layer"),
        ("settled_step", "settled"), ("same_outputs_as_step_before", "same outputs 1 back"),
        ("same_outputs_as_two_steps_before", "2 back"), ("captures_by_step", "captures"),
        ("torch_kept_mib", "torch kept MiB"),
        ("device_kept_mib", "device kept MiB"), ("torch_mib_per_graph", "torch MiB / graph"),
        ("driver_mib_per_graph", "driver MiB / graph"), "error"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2,4,8")
    p.add_argument("--layers", default="2,8,32,61,64,80,126,128", help="depths, comma-separated")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--steps", type=int, default=12, help="steps per case, the last two measured (at least 3)")
    p.add_argument("--transport", choices=("host", "peer"), default="host")
    p.add_argument("--deadline", type=float, default=400.0, help="seconds a world may take before its ranks are killed")
    p.add_argument("--tag", default="h200")
    p.add_argument("--note", default="")
    p.add_argument("--out-dir", default=str(output.RESULTS))
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if any(k not in KINDS for k in kinds) or args.steps < 3:
        raise SystemExit(f"--kinds: among {', '.join(KINDS)}; --steps: at least 3")
    if not torch.cuda.is_available():
        raise SystemExit("fused_replay_scale runs the CUDA path: it needs a GPU")
    from compass_fx.kernels.cuda import replay

    todo = cases(kinds, [int(d) for d in args.layers.split(",") if d])
    rows: list[dict] = []
    payload = {"benchmark": NAME, "tag": args.tag, "note": args.note, "steps": args.steps,
               "transport": args.transport, "replay_limit": replay.limit(),
               "environment": output.environment(False), "rows": rows}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for world in (int(w) for w in args.worlds.split(",") if w):
            rows += world_rows(world, todo, args.steps, args.transport, tmp, args.deadline)
            payload["seconds"] = round(time.time() - t0, 1)
            output.write_results(NAME, args.tag, payload, markdown(payload), args.out_dir)  # what is done so far
    print(markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
