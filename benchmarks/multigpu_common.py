"""Shared helpers of the multi-GPU benchmarks (``multigpu_correctness.py``, ``multigpu_operators.py``,
``multigpu_end_to_end.py``).

* Launching: one process per GPU, either spawned here (``--worlds 2,4,8`` runs one launch per world
  size, one after another) or under ``torchrun`` (one world, taken from the environment).  NCCL on
  CUDA, gloo on CPU (``--dry-run``).  NVLink multicast is kept off in every process
  (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``).
* The three pair kinds as plain operator-level functions, one per strategy (sequential,
  InterDecom(d) written with functional collectives exactly as ``compass_fx.lowering.decompose``
  emits it, IntraFusion through ``torch.ops.compass.*``, PyTorch's ``torch.ops.symm_mem`` fused
  ops), each with its backward.
* Timing (CUDA events, median of repeats, the slowest rank's median), progress lines, and the
  JSON + markdown writers (the device in the file name: ``-h200x8``, ``-cpu``).

Only rank 0 writes files or prints tables.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Keep NVLink multicast (NVLS / multimem) off in every process we launch.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
for _k, _v in NO_MULTICAST_ENV.items():
    os.environ[_k] = _v

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from compass_fx.tools.timing import seconds_of_one_call  # noqa: E402

c10d = torch.ops._c10d_functional
PAIR_KINDS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")


# =============================================================================================
# launching
# =============================================================================================
@dataclass
class Ctx:
    """What a worker knows about its process."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str
    dry_run: bool

    @property
    def group_name(self) -> str:
        return dist.group.WORLD.group_name

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)


def add_launch_args(p, default_worlds: str = "") -> None:
    p.add_argument("--dry-run", action="store_true",
                   help="CPU ranks over gloo, tiny shapes, fp32: checks the script end to end")
    p.add_argument("--worlds", default=default_worlds,
                   help="comma-separated world sizes to launch one after another (default: correctness and "
                        "operators 2,4,8 up to the GPU count, end to end every GPU; 2 with --dry-run). "
                        "Ignored under torchrun.")
    p.add_argument("--out-dir", default=str(RESULTS), help="where the JSON and markdown go")
    p.add_argument("--tag", default=None, help="device tag in the file names (default: e.g. h200x8 or cpu)")


def parse_worlds(text: str, dry_run: bool) -> list[int]:
    if text:
        return [int(w) for w in text.replace(" ", "").split(",") if w]
    if dry_run:
        return [2]
    n = torch.cuda.device_count()
    if n < 2:
        raise SystemExit(f"found {n} GPU(s); these benchmarks need at least 2 (or --dry-run on CPU)")
    return [n]


def group_size_worlds(text: str, dry_run: bool) -> list[int]:
    """``--worlds`` if given, else every group size of the paper's grid (2, 4, 8) that fits the GPUs."""
    if text or dry_run:
        return parse_worlds(text, dry_run)
    n = torch.cuda.device_count()
    worlds = [g for g in (2, 4, 8) if g <= n]
    if not worlds:
        raise SystemExit(f"found {n} GPU(s); these benchmarks need at least 2 (or --dry-run on CPU)")
    return worlds


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, local_rank: int, dry_run: bool, init_method: str | None) -> Ctx:
    for k, v in NO_MULTICAST_ENV.items():
        os.environ[k] = v
    if dry_run:
        backend, device = "gloo", torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: use --dry-run on a CPU machine")
        backend, device = "nccl", torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    kwargs: dict[str, Any] = {"rank": rank, "world_size": world}
    if init_method:
        kwargs["init_method"] = init_method
    dist.init_process_group(backend, **kwargs)
    return Ctx(rank, world, local_rank, device, backend, dry_run)


TEARDOWN_WARNINGS: list[str] = []


def _teardown() -> None:
    """Release finished work objects, then destroy the process group (gloo's worker threads can
    otherwise hold the last references to tensors while the interpreter shuts down)."""
    import gc

    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, dry_run: bool, fn, args, out_path: str) -> None:
    ctx = _init(rank, world, rank, dry_run, f"tcp://127.0.0.1:{port}")
    try:
        result = fn(ctx, args)
        barrier(ctx)  # every rank finished its work before rank 0 declares the run complete
        if rank == 0:
            with open(out_path + ".tmp", "w") as fh:
                json.dump(result, fh, default=str)
            os.replace(out_path + ".tmp", out_path)
    finally:
        _teardown()


def run_worlds(fn: Callable[[Ctx, Any], Any], args, worlds: Sequence[int]) -> list[tuple[int, Any]]:
    """Run ``fn(ctx, args)`` on every rank of each world size; return [(world, rank 0's result)].

    Under torchrun this process is one rank: the result list holds this world only, and is
    meaningful on rank 0 only (other ranks get their own return values)."""
    if under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        ctx = _init(rank, world, int(os.environ["LOCAL_RANK"]), args.dry_run, None)
        import atexit

        atexit.register(_teardown)  # after rank 0 has written its files
        result = fn(ctx, args)
        barrier(ctx)
        return [(world, result)]
    import torch.multiprocessing as mp

    if not args.dry_run and max(worlds) > torch.cuda.device_count():
        raise SystemExit(f"asked for worlds {list(worlds)} but only {torch.cuda.device_count()} GPU(s) are visible")
    out = []
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "rank0.json")
            print(f"== launching {world} ranks ({'gloo/CPU' if args.dry_run else 'NCCL/CUDA'})", flush=True)
            try:
                mp.spawn(_spawned, args=(world, _free_port(), args.dry_run, fn, args, path), nprocs=world, join=True)
            except mp.ProcessExitedException as e:
                if not os.path.exists(path):
                    raise
                # Every rank had finished (rank 0 writes after a final barrier): a crash while
                # tearing the process group down loses nothing; say so and keep the results.
                msg = f"world {world}: a rank died while tearing down after the run completed ({e})"
                TEARDOWN_WARNINGS.append(msg)
                print(f"WARNING: {msg}", file=sys.stderr, flush=True)
            with open(path) as fh:
                out.append((world, json.load(fh)))
    return out


def launch(fn: Callable[[Ctx, Any], Any], args, worlds: Sequence[int]) -> tuple[list[tuple[int, Any]], str, float] | None:
    """``run_worlds`` plus what every script's writer needs next: (results, device tag, start
    time); None in a process that does not write the files."""
    t0 = time.time()
    results = run_worlds(fn, args, worlds)
    if not is_writer():
        return None
    return results, args.tag or device_tag(args.dry_run, max(w for w, _ in results)), t0


def is_writer() -> bool:
    """The process that writes the files: rank 0 under torchrun, the parent otherwise."""
    return not under_torchrun() or int(os.environ["RANK"]) == 0


# =============================================================================================
# environment and files
# =============================================================================================
def device_tag(dry_run: bool, world: int | None = None) -> str:
    """``cpu`` for a dry run, else e.g. ``h200x8`` (GPU model and the GPU count of the run)."""
    if dry_run or not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower()
    model = next((tok for tok in name.replace("-", " ").split() if any(ch.isdigit() for ch in tok)), "gpu")
    return f"{model}x{world or torch.cuda.device_count()}"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment(dry_run: bool) -> dict:
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
        "commit": git_commit(), "dry_run": dry_run,
        "env": {k: os.environ.get(k) for k in (*NO_MULTICAST_ENV, "NCCL_P2P_DISABLE", "COMPASS_FUSED_TRANSPORT")},
        "teardown_warnings": list(TEARDOWN_WARNINGS),
    }
    if not dry_run and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpus_visible"] = torch.cuda.device_count()
        env["cuda"] = torch.version.cuda
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            pass
    else:
        env["cpus"] = os.cpu_count()
    try:
        import triton  # noqa: F401
        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        env["triton"] = None
    return env


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.{digits}g}"
        return f"{value:.{digits}f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: Sequence[dict], columns: Sequence[str | tuple[str, str]]) -> str:
    """A GitHub markdown table; a column is a key or (key, header)."""
    cols = [(c, c) if isinstance(c, str) else c for c in columns]
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(k)) for k, _ in cols) + " |")
    return "\n".join(lines)


def write_results(name: str, tag: str, payload: dict, markdown: str, out_dir: str | os.PathLike = RESULTS
                  ) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jpath, mpath = out / f"{name}-{tag}.json", out / f"{name}-{tag}.md"
    jpath.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    mpath.write_text(markdown.rstrip() + "\n")
    print(f"wrote {jpath} and {mpath}", flush=True)
    return jpath, mpath


class Progress:
    """``[i/n] label (elapsed, eta)`` lines on rank 0."""

    def __init__(self, ctx: Ctx, total: int, what: str) -> None:
        self.ctx, self.total, self.what, self.t0, self.done = ctx, max(total, 1), what, time.time(), 0

    def step(self, label: str) -> None:
        self.done += 1
        el = time.time() - self.t0
        eta = el / self.done * (self.total - self.done)
        self.ctx.log(f"[{self.what} {self.done}/{self.total}] {label}  ({el:.0f}s elapsed, ~{eta:.0f}s left)")


# =============================================================================================
# timing
# =============================================================================================
def synchronize(ctx: Ctx) -> None:
    if ctx.is_cuda:
        torch.cuda.synchronize(ctx.device)


def barrier(ctx: Ctx) -> None:
    """Every rank here before any goes on (a tiny all-reduce on the device, then a sync)."""
    dist.all_reduce(torch.zeros(1, device=ctx.device))
    synchronize(ctx)


def time_fn(ctx: Ctx, fn: Callable[[], Any], warmup: int, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` (after ``warmup`` calls), each call started after a
    barrier; the slowest rank's median (every rank returns the same number).

    CUDA: events around each call; CPU: wall clock."""
    for _ in range(warmup):
        fn()
    synchronize(ctx)
    times = []
    for _ in range(repeats):
        barrier(ctx)
        if ctx.is_cuda:
            torch.cuda.synchronize(ctx.device)
        times.append(seconds_of_one_call(fn, ctx.is_cuda))
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def time_back_to_back(ctx: Ctx, fn, batch: int, batches: int, device_only: bool = False) -> float:
    """Median over ``batches`` of the mean seconds per call of ``batch`` back-to-back calls; the
    slowest rank's figure.  ``device_only``: the GPU first sleeps 20 ms so that the host has queued
    every call before the first starts: the device's time alone, without the host's launch cost."""
    for _ in range(3):
        fn()
    per_call = []
    for _ in range(batches):
        barrier(ctx)
        if ctx.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if device_only:
                torch.cuda._sleep(int(20e-3 * 1.98e9))
            start.record()
            for _ in range(batch):
                fn()
            end.record()
            end.synchronize()
            per_call.append(start.elapsed_time(end) / 1e3 / batch)
        else:
            t0 = time.perf_counter()
            for _ in range(batch):
                fn()
            per_call.append((time.perf_counter() - t0) / batch)
    return max_over_ranks(ctx, statistics.median(per_call))


def warm_up(ctx: Ctx, fn: Callable[[], Any], calls: int) -> None:
    """Call ``fn`` (compiling it, building its workspaces) and wait for the device."""
    for _ in range(max(1, calls)):
        fn()
    synchronize(ctx)


def _batch_seconds(ctx: Ctx, fn: Callable[[], Any], batch: int) -> float:
    """Mean seconds per call of ``batch`` back-to-back calls started after a barrier."""
    barrier(ctx)
    if not ctx.is_cuda:
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        return (time.perf_counter() - t0) / batch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(batch):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / batch


def time_interleaved(ctx: Ctx, fns: dict[str, Callable[[], Any]], batch: int, rounds: int
                     ) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per call of each of ``fns`` (warmed up), measured side by side: each of ``rounds``
    rounds times one back-to-back batch of every function, the order rotated by one per round.
    Returns (median over rounds, interquartile range over rounds / median), the slowest rank's."""
    labels = list(fns)
    samples: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(rounds):
        shift = r % len(labels)
        for label in labels[shift:] + labels[:shift]:
            samples[label].append(_batch_seconds(ctx, fns[label], max(1, batch)))

    def spread(xs: list[float]) -> float:
        if len(xs) < 4:
            return (max(xs) - min(xs)) / statistics.median(xs)
        q = statistics.quantiles(xs, n=4)
        return (q[2] - q[0]) / statistics.median(xs)

    figures = torch.tensor([[statistics.median(samples[x]) for x in labels], [spread(samples[x]) for x in labels]],
                           dtype=torch.float64, device=ctx.device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    medians, spreads = figures.tolist()
    return dict(zip(labels, medians)), dict(zip(labels, spreads))


def busy_seconds(spans: Sequence[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: time during which at least one ran."""
    total, cur = 0.0, None
    for start, end in sorted(spans):
        if cur is None or start > cur[1]:
            total += (cur[1] - cur[0]) if cur else 0.0
            cur = [start, end]
        else:
            cur[1] = max(cur[1], end)
    return total + ((cur[1] - cur[0]) if cur else 0.0)


def gpu_category(name: str) -> str:
    """What a profiled GPU activity is: nccl, gemm, copy_dtoh / copy_htod / copy_dtod / copy_peer
    (copy engines), or other (kernels: elementwise, attention, reductions ...)."""
    low = name.lower()
    if "nccl" in low:
        return "nccl"
    if low.startswith("memcpy"):
        for tag, cat in (("dtoh", "copy_dtoh"), ("htod", "copy_htod"), ("ptop", "copy_peer"), ("dtod", "copy_dtod")):
            if tag in low:
                return cat
        return "copy_other"
    if any(t in low for t in ("gemm", "sm90", "cutlass", "xmma", "nvjet", "matmul")):
        return "gemm"
    return "other"


def gpu_time_summary(prof, steps: int, top: int = 12) -> dict:
    """Per step, from a torch.profiler run on one rank: busy milliseconds per category of GPU
    activity (each category's union of intervals), the GPU's busy and idle time, how much of the
    communication (NCCL and copies) ran beside a GEMM, and the costliest kernels."""
    events = [e for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0]
    if not events:
        return {"note": "no GPU activity recorded"}
    spans: dict[str, list] = {}
    by_name: dict[str, list] = {}
    for e in events:
        spans.setdefault(gpu_category(e.name), []).append((e.time_range.start, e.time_range.end))
        by_name.setdefault(e.name[:90], []).append(e.time_range.elapsed_us())
    every = [x for v in spans.values() for x in v]
    wall = max(t for _, t in every) - min(s for s, _ in every)
    comm = [x for k, v in spans.items() if k == "nccl" or k.startswith("copy") for x in v]
    gemm = spans.get("gemm", [])
    overlap = busy_seconds(comm) + busy_seconds(gemm) - busy_seconds(comm + gemm)
    per = 1e-3 / steps  # microseconds -> ms per step
    costly = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"steps": steps, "span_ms": wall * per, "busy_ms": busy_seconds(every) * per,
            "idle_ms": (wall - busy_seconds(every)) * per,
            "busy_ms_by_category": {k: busy_seconds(v) * per for k, v in sorted(spans.items())},
            "count_by_category": {k: len(v) / steps for k, v in sorted(spans.items())},
            "communication_beside_gemm_ms": overlap * per,
            "top_kernels": [{"name": n, "ms": sum(t) * per, "count": len(t) / steps} for n, t in costly]}


def all_ok(ctx: Ctx, ok: bool) -> bool:
    """True when ``ok`` holds on every rank."""
    t = torch.tensor([0.0 if ok else 1.0], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() == 0.0


def max_over_ranks(ctx: Ctx, value: float) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def guarded(ctx: Ctx, what: str, fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """Run ``fn``; (result, None) or (None, error) — agreed across ranks so that no rank goes on
    alone into a collective the others skip."""
    try:
        result, err = fn(), None
    except Exception as e:  # noqa: BLE001
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        said = " ... ".join(dict.fromkeys([lines[0], lines[-1]])) if lines else ""  # a wrapper's first line, the cause's last
        result, err = None, f"{type(e).__name__}: {said}"[:500]
        if os.environ.get("COMPASS_BENCH_TRACEBACK"):
            traceback.print_exc()
    if not all_ok(ctx, err is None):
        return None, err or f"{what}: failed on another rank"
    return result, None


# =============================================================================================
# the three pairs, one function per strategy (operator level)
# =============================================================================================
def _ag(x: torch.Tensor, world: int, group: str) -> torch.Tensor:
    return c10d.all_gather_into_tensor(x.contiguous(), world, group)


def _rs(x: torch.Tensor, world: int, group: str) -> torch.Tensor:
    return c10d.reduce_scatter_tensor(x.contiguous(), "sum", world, group)


def _ar(x: torch.Tensor, group: str) -> torch.Tensor:
    return c10d.all_reduce(x.contiguous(), "sum", group)


def _wait(x: torch.Tensor) -> torch.Tensor:
    return c10d.wait_tensor(x)


def ag_mm_decomposed(a_shard: torch.Tensor, b: torch.Tensor, d: int, world: int, group: str) -> torch.Tensor:
    """InterDecom of all_gather -> mm on dim 0: the gather of part i+1 is issued before the mm of
    part i; the outputs are interleaved back to rank-major rows (as the lowering's interleave_rows)."""
    rows = a_shard.shape[0]
    if rows % d:
        raise ValueError(f"d={d} does not divide the {rows} local rows")
    if d == 1:
        return _wait(_ag(a_shard, world, group)) @ b
    c = rows // d
    pending = [_ag(a_shard[:c], world, group)]
    outs = []
    for i in range(d):
        if i + 1 < d:
            pending.append(_ag(a_shard[(i + 1) * c:(i + 2) * c], world, group))
        outs.append(_wait(pending[i]) @ b)  # [world * c, n], rank-major blocks of part i
    n = b.shape[1]
    return torch.stack(outs).view(d, world, c, n).transpose(0, 1).reshape(world * rows, n)


def _part_rows(a: torch.Tensor, world: int, d: int, i: int) -> torch.Tensor:
    """Rows of part i for a reduce-scatter on dim 0: sub-block i of every rank's block."""
    m, k = a.shape
    c = m // (world * d)
    return a.view(world, d, c, k)[:, i].reshape(world * c, k)


def mm_rs_decomposed(a: torch.Tensor, b: torch.Tensor, d: int, world: int, group: str) -> torch.Tensor:
    """InterDecom of mm -> reduce_scatter on dim 0: the collective of part i is issued right
    after its mm, so it travels while the mm of part i+1 runs; waits at the end."""
    m = a.shape[0]
    if m % (world * d):
        raise ValueError(f"d={d} x world={world} does not divide the {m} rows")
    if d == 1:
        return _wait(_rs(a @ b, world, group))
    pending = [_rs(_part_rows(a, world, d, i) @ b, world, group) for i in range(d)]
    return torch.cat([_wait(p) for p in pending], 0)


def mm_ar_decomposed(a: torch.Tensor, b: torch.Tensor, d: int, world: int, group: str) -> torch.Tensor:
    m = a.shape[0]
    if m % d:
        raise ValueError(f"d={d} does not divide the {m} rows")
    if d == 1:
        return _wait(_ar(a @ b, group))
    c = m // d
    pending = [_ar(a[i * c:(i + 1) * c] @ b, group) for i in range(d)]
    return torch.cat([_wait(p) for p in pending], 0)


class _AgMmDecomposed(torch.autograd.Function):
    """Forward InterDecom(d) of all_gather->mm; backward: its mirror pair, mm->reduce_scatter,
    decomposed the same way (d a = RS(g @ b^T)), and d b = gathered^T @ g."""

    @staticmethod
    def forward(ctx, a_shard, b, d, world, group):
        ctx.save_for_backward(a_shard, b)
        ctx.args = (d, world, group)
        return ag_mm_decomposed(a_shard, b, d, world, group)

    @staticmethod
    def backward(ctx, g):
        a_shard, b = ctx.saved_tensors
        d, world, group = ctx.args
        grad_a = mm_rs_decomposed(g, b.t(), d, world, group)
        grad_b = None
        if ctx.needs_input_grad[1]:
            grad_b = _wait(_ag(a_shard, world, group)).t() @ g
        return grad_a, grad_b, None, None, None


class _MmRsDecomposed(torch.autograd.Function):
    """Forward InterDecom(d) of mm->reduce_scatter; backward: all_gather->mm decomposed the same way."""

    @staticmethod
    def forward(ctx, a, b, d, world, group):
        ctx.save_for_backward(a, b)
        ctx.args = (d, world, group)
        return mm_rs_decomposed(a, b, d, world, group)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        d, world, group = ctx.args
        g_gathered = _wait(_ag(g, world, group))
        grad_a = ag_mm_decomposed(g, b.t(), d, world, group)
        return grad_a, a.t() @ g_gathered, None, None, None


class _MmArDecomposed(torch.autograd.Function):
    """Forward InterDecom(d) of mm->all_reduce; backward in the row-parallel convention (the
    replicated output gradient needs no collective), as compass::matmul_all_reduce does."""

    @staticmethod
    def forward(ctx, a, b, d, world, group):
        ctx.save_for_backward(a, b)
        return mm_ar_decomposed(a, b, d, world, group)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g @ b.t(), a.t() @ g, None, None, None


def strategy_fn(kind: str, label: str, world: int, group: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The pair ``kind`` run by strategy ``label``: "sequential", "decompose(d=4)", "fuse(ring)",
    "symm_mem" (PyTorch's fused op; CUDA, or its Python fallback elsewhere).  Differentiable
    (symm_mem: forward only).  Operands: all_gather_matmul (a_shard [m/w, k], b [k, n]) -> [m, n];
    matmul_reduce_scatter (a [m, k], b) -> [m/w, n]; matmul_all_reduce (a [m, k], b) -> [m, n]."""
    if kind not in PAIR_KINDS:
        raise ValueError(kind)
    if label == "sequential" or label.startswith("decompose"):
        d = 1 if label == "sequential" else int(label.split("=")[1].rstrip(")"))
        fn = {"all_gather_matmul": _AgMmDecomposed, "matmul_reduce_scatter": _MmRsDecomposed,
              "matmul_all_reduce": _MmArDecomposed}[kind]
        return lambda a, b: fn.apply(a, b, d, world, group)
    if label.startswith("fuse("):
        import compass_fx.kernels  # noqa: F401 - registers torch.ops.compass
        schedule = label[5:-1]
        if kind == "all_gather_matmul":
            return lambda a, b: torch.ops.compass.all_gather_matmul(a, [b], schedule, group, world)[1][0]
        op = getattr(torch.ops.compass, kind)
        return lambda a, b: op(a, b, schedule, group, world)
    if label == "symm_mem":
        if kind == "matmul_all_reduce":
            raise ValueError("PyTorch has no fused matmul + all-reduce")
        if torch.cuda.is_available() and dist.get_backend() == "nccl":
            from torch.distributed._symmetric_memory import enable_symm_mem_for_group
            enable_symm_mem_for_group(group)
            if kind == "all_gather_matmul":
                return lambda a, b: torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, group)[1][0]
            return lambda a, b: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group)
        from torch.distributed import _symmetric_memory as sm
        if kind == "all_gather_matmul":
            return lambda a, b: sm._fused_all_gather_matmul_fallback(a, [b], 0, group)[1][0]
        return lambda a, b: sm._fused_matmul_reduce_scatter_fallback(a, b, "sum", 0, group)
    raise ValueError(f"unknown strategy label {label!r}")


class PairGraph(torch.nn.Module):
    """One pair as a model would trace it: functional collective + wait + mm, so that
    ``backend="compass"`` finds it and rewrites it exactly as in a real graph."""

    def __init__(self, kind: str, world: int, group: str) -> None:
        super().__init__()
        self.kind, self.world, self.group = kind, world, group

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.kind == "all_gather_matmul":
            return _wait(_ag(a, self.world, self.group)) @ b
        if self.kind == "matmul_reduce_scatter":
            return _wait(_rs(a @ b, self.world, self.group))
        return _wait(_ar(a @ b, self.group))


def lowered_options(label: str) -> dict:
    """backend="compass" options that force the strategy ``label`` names."""
    if label == "sequential":
        return {"strategy": "off"}
    if label.startswith("decompose(d="):
        return {"strategy": "decompose", "chunks": int(label.split("=")[1].rstrip(")"))}
    if label.startswith("fuse("):
        return {"strategy": "fuse", "schedule": label[5:-1]}
    raise ValueError(f"unknown strategy label {label!r}")


def lowered_fn(kind: str, label: str, world: int, group: str, inner: str = "eager"
               ) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], Callable[[], list[str]]]:
    """The pair run as compass_fx's own rewrite emits it for strategy ``label`` (``torch.compile``
    with backend="compass" forcing that strategy, ``inner`` compiling the result), and a function
    that returns what the compiler did with the pair once it has been called (e.g. "rewritten
    decompose(4)" or "left alone ...": a forced strategy the pair cannot take shows there)."""
    import compass_fx

    torch._dynamo.reset()
    compiled = torch.compile(PairGraph(kind, world, group), backend="compass", dynamic=False,
                             options={**lowered_options(label), "inner": inner})
    before = len(compass_fx.backend.history)
    return compiled, lambda: pair_outcomes(before)


def pair_outcomes(before: int) -> list[str]:
    """What the compiler did with each pair of the graphs compiled since ``len(backend.history)``
    was ``before``: "rewritten decompose(4)", "rewritten fuse(direct)", "kept sequential(1): why"."""
    import compass_fx

    return [f"{p.status} {p.strategy}({p.schedule if p.strategy == 'fuse' else p.parts})"
            + (f": {p.reason}" if p.status != "rewritten" else "")
            for r in list(compass_fx.backend.history)[before:] for p in r.pairs]


def pair_operands(kind: str, m: int, n: int, k: int, world: int, rank: int, dtype: torch.dtype,
                  device: torch.device, seed: int = 0, requires_grad: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's operands of a pair whose full activation has ``m`` rows (distinct per rank)."""
    g = torch.Generator(device=device).manual_seed(seed * 1000 + rank)  # on the device: fast at 70B widths
    rows = m // world if kind == "all_gather_matmul" else m
    a = (torch.randn(rows, k, generator=g, device=device) / k ** 0.25).to(dtype=dtype)
    b = (torch.randn(k, n, generator=g, device=device) / k ** 0.25).to(dtype=dtype)
    return a.requires_grad_(requires_grad), b.requires_grad_(requires_grad)


def output_rows(kind: str, m: int, world: int) -> int:
    return m // world if kind == "matmul_reduce_scatter" else m


def gemm_only_fn(kind: str, a: torch.Tensor, b: torch.Tensor, world: int) -> Callable[[], Any]:
    """The pair's GEMM alone, at the shape it has in the sequential version."""
    if kind == "all_gather_matmul":
        full = a.new_empty((a.shape[0] * world, a.shape[1])).normal_()
        return lambda: full @ b
    return lambda: a @ b


def comm_only_fn(kind: str, a: torch.Tensor, b: torch.Tensor, world: int, group: str) -> Callable[[], Any]:
    """The pair's collective alone, on a tensor of the size it moves in the sequential version."""
    if kind == "all_gather_matmul":
        return lambda: _wait(_ag(a, world, group))
    out = a.new_empty((a.shape[0], b.shape[1])).normal_()
    if kind == "matmul_reduce_scatter":
        return lambda: _wait(_rs(out, world, group))
    return lambda: _wait(_ar(out, group))


def model_topology(ctx: Ctx):
    """(Topology, how it was obtained): detected on GPUs, the default preset on a CPU dry run."""
    from compass_fx.machine import Topology
    if ctx.is_cuda:
        try:
            return Topology.detect(), "Topology.detect()"
        except Exception as e:  # noqa: BLE001
            topo = Topology.default()
            return topo, f"Topology.default() after detect() failed: {e}"
    return Topology.default(), "Topology.default() (CPU dry run: no GPU to detect)"
