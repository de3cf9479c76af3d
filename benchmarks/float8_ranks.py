"""Float8 training steps with their pairs decomposed, on real NCCL ranks sharing ONE GPU, against eager.

Why: float8 pairs are decomposed (the fused operators are not offered for float8), and every float8
rewrite had been checked on CPU ranks only (gloo; ``_scaled_mm``'s CPU kernel).  CUDA's float8 GEMM
asks more of its operands (B column-major, row scales of A with a last stride of 1, dims multiples
of 16): a part the rewrite cuts must still be one it takes.  Here each rank runs a training step of
a float8 block, eager and compiled with every pair decomposed in two parts (inner compilers eager
and Inductor), on CUDA, and compares the output, the input gradient and every weight gradient.

Ranks share the GPU as in ``parts_replay_ranks.py``: each its own ``NCCL_HOSTID``, so NCCL connects
them over loopback sockets (run under MPS).  Models: ``tests/float8_block.py``'s hand-built block
(tensorwise, constant scales; bf16 rows gathered then cast, or float8 bytes gathered), and where
torchao imports, ``tests/torchao_stack.py``'s torchao layers (tensorwise with its float8 TP styles,
row-wise with the plain ones: each part replays the row-wise quantization of its rows).

Tolerance as the CPU tests': 1e-2 relative, 1e-2 of the tensor's largest magnitude absolute (bf16
results; a weight gradient's parts are float32 sums rounded once).  Beside it the SQNR (dB), and each
step against the same model compiled with nothing rewritten by the same compiler: on a GPU, Inductor
rounds float8 scales and casts otherwise than eager (any Inductor compile of torchao's stacks, torch's
own included, differs from eager by up to 0.14, 20-28 dB), so a rewrite is judged against
``off-inductor``, or exactly with ``--env TORCHINDUCTOR_EMULATE_PRECISION_CASTS=1 --env
TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING=1`` (set them in the shell too: Inductor reads them once).

    python benchmarks/float8_ranks.py --worlds 2,4   # one GPU, under MPS
    python benchmarks/float8_ranks.py --dry-run      # CPU, gloo, world 2: the script end to end

torchao is not installed on the lent GPU machine: its float8 training is Python, so its source can
travel with the checkout (the device tool's ``carry``) and go on ``PYTHONPATH`` there::

    mkdir -p scratch/carry && cp -r "$(python -c 'import torchao, os; print(os.path.dirname(torchao.__file__))')" scratch/carry/
    rm -rf scratch/carry/torchao/*.so scratch/carry/torchao/csrc   # compiled kernels the float8 path does not need
    PYTHONPATH=$PWD/scratch/carry python3 benchmarks/float8_ranks.py --models torchao_tensorwise,torchao_rowwise
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import launch, output  # noqa: E402  (sets the no-multicast environment first)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

NAME = "float8_ranks"
TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
TOL = 1e-2
MODELS = ("block", "block_bytes", "torchao_tensorwise", "torchao_rowwise")
STRATEGIES = {"off-eager": {"strategy": "off", "inner": "eager"},  # baselines: compiled, nothing rewritten
              "off-inductor": {"strategy": "off", "inner": "inductor"},
              "decompose-eager": {"chunks": 2, "inner": "eager"},
              "decompose-inductor": {"chunks": 2, "inner": "inductor"}}
# torch's own backends, without compass: where compiled and eager differ, is it the compile or compass?
# (aot_eager_decomp_partition: AOTAutograd with Inductor's decompositions and partitioner, run eagerly)
TORCH_BACKENDS = {"torch-aot_eager": "aot_eager", "torch-aot_eager_decomp_partition": "aot_eager_decomp_partition",
                  "torch-inductor": "inductor"}
LAYERS, ROWS = 2, 32  # torchao layers; a rank's rows of tokens


def build(name: str, world: int, device: str):
    """The model ``name`` on ``device`` (the same weights on every rank) and this rank's input rows."""
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    if name.startswith("block"):
        import float8_block

        model = float8_block.Float8Block(world, dist.group.WORLD.group_name, name == "block_bytes").to(device)
        x = torch.randn(float8_block.TOKENS, float8_block.DIM, generator=torch.Generator().manual_seed(8))
        return model, x.to(torch.bfloat16).chunk(world)[dist.get_rank()].contiguous().to(device)
    import torchao_stack
    from torch.distributed.device_mesh import init_device_mesh

    with torch.device(device):
        model = torchao_stack.build(name.removeprefix("torchao_"), LAYERS, init_device_mesh(device, (world,)))
    x = torch.randn(ROWS, torchao_stack.DIM, generator=torch.Generator().manual_seed(9 + dist.get_rank()))
    return model, x.to(torch.bfloat16).to(device)


def compare(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[float, list[str], dict, float]:
    """The worst difference over each tensor's largest magnitude, the tensors off by more than the
    tolerance, which of their rows (a part's or a rank's rows point at the rewrite's cut), and the
    lowest signal-to-quantization-noise ratio over the tensors (dB; torchao's own measure of float8
    numerics: one float8 rounding that flips moves an element by 6-25%, so two compiles of the same
    step may differ by more than the tolerance while agreeing to 20-30 dB)."""
    worst, wrong, wrong_rows, sqnr = 0.0, [], {}, math.inf
    for key, ref in expected.items():
        ref, out = ref.float(), got[key].float()
        scale = max(ref.abs().max().item(), 1e-30)
        diff = (out - ref).abs()
        worst = max(worst, diff.max().item() / scale)
        noise = diff.norm().item()
        if noise > 0:
            sqnr = min(sqnr, 20 * math.log10(max(ref.norm().item(), 1e-30) / noise))
        if not torch.allclose(out, ref, rtol=TOL, atol=TOL * scale):
            wrong.append(key)
            if diff.dim() == 2:
                bad = diff > TOL * scale + TOL * ref.abs()
                wrong_rows[key] = bad.any(dim=1).nonzero().flatten().tolist()
    return worst, wrong, wrong_rows, sqnr


def _decibels(sqnr: float) -> float | str:
    """An SQNR as the results keep it: "equal" where nothing differs (JSON has no infinity)."""
    return "equal" if math.isinf(sqnr) else round(sqnr, 1)


def inner_of(strategy: str) -> str:
    """The compiler that runs ``strategy``'s graphs (eager or Inductor): its compiled-off baseline is
    the step compiled with nothing rewritten by the same compiler."""
    if strategy in TORCH_BACKENDS:
        return "inductor" if TORCH_BACKENDS[strategy] == "inductor" else "eager"
    return STRATEGIES[strategy]["inner"]


def check(name: str, strategy: str, world: int, device: str, baseline: dict | None,
          inductor_config: dict | None = None) -> tuple[dict, dict]:
    """Eager against compiled with ``strategy``, on the same weights and rows (and the compiled step
    against ``baseline``, the same model compiled with nothing rewritten by the same compiler): the
    worst errors and the pairs; and the compiled step's tensors.  ``inductor_config``: Inductor settings
    patched while the step compiles and runs (AOTAutograd's joint-graph passes run in every compass
    compile, an eager inner compiler's too)."""
    import compass_fx.backend

    torch._dynamo.reset()
    model, x = build(name, world, device)  # puts the tests on the path
    from float8_block import training_step

    expected = training_step(model, x)
    before = len(compass_fx.backend.history)
    if strategy in TORCH_BACKENDS:
        compiled = torch.compile(model, backend=TORCH_BACKENDS[strategy], fullgraph=True)
    else:
        compiled = torch.compile(model, backend="compass", options=STRATEGIES[strategy], fullgraph=True)
    with torch._inductor.config.patch(inductor_config or {}):
        got = training_step(model, x, compiled)
    worst, wrong, wrong_rows, sqnr = compare(got, expected)
    row = {"model": name, "strategy": strategy, "status": "FAIL" if wrong else "pass", "wrong": wrong,
           "wrong_rows": wrong_rows, "worst_error": worst, "sqnr_db": _decibels(sqnr)}
    if baseline is not None:
        worst_off, wrong_off, _, sqnr_off = compare(got, baseline)
        row.update(status_vs_off="FAIL" if wrong_off else "pass", worst_vs_off=worst_off, wrong_vs_off=wrong_off,
                   sqnr_vs_off_db=_decibels(sqnr_off), vs_off=f"off-{inner_of(strategy)}")
    pairs = [p for r in list(compass_fx.backend.history)[before:] for p in r.pairs]
    row.update(pairs=len(pairs), decomposed=sum(p.status == "rewritten" and p.strategy == "decompose" for p in pairs),
               backward_decomposed=sum(p.status == "rewritten" and p.graph == "backward" for p in pairs),
               not_rewritten=sorted({f"{p.graph} {p.kind}: {p.reason}" for p in pairs if p.status != "rewritten"}))
    return row, got


def run_cases(rank: int, world: int, models: list[str], strategies: list[str], device: str,
              inductor_config: dict) -> list[dict]:
    """Every model's step under every strategy on this rank of the current group, one row each (a
    case that raised is a row with its error); the ranks meet after each case."""
    cases: list[dict] = []
    for name in models:
        baselines: dict[str, dict] = {}  # inner compiler -> its compiled step with nothing rewritten
        for strategy in strategies:
            try:
                own = strategy.startswith("off-")
                row, got = check(name, strategy, world, device,
                                 None if own else baselines.get(inner_of(strategy)), inductor_config)
                cases.append(row)
                if own:
                    baselines[inner_of(strategy)] = got
            except Exception as e:  # noqa: BLE001 - this case's outcome
                cases.append({"model": name, "strategy": strategy, "status": "error",
                              "error": f"{type(e).__name__}: {e}"[:600], "traceback": traceback.format_exc()[-1500:]})
            dist.barrier()
            print(f"[rank {rank}/{world}] {name} {strategy}: {cases[-1]['status']}", file=sys.stderr, flush=True)
    return cases


def _float8_gathers_on_gloo():
    """gloo has no float8 collectives: a dry run's gathers move the bytes (``tests/float8_gloo.py``)."""
    if TESTS not in sys.path:
        sys.path.insert(0, TESTS)
    from float8_gloo import float8_gathers_on_gloo

    return float8_gathers_on_gloo()


def _outcome(rank: int, cases: list[dict]) -> dict:
    return {"rank": rank, "cases": cases, "status": "pass" if all(c["status"] == "pass" for c in cases) else "FAIL"}


def worker(rank: int, world: int, models: list[str], strategies: list[str], dry_run: bool, env: dict[str, str],
           inductor_config: dict, init: str, out_path: str) -> None:
    """One rank: NCCL over loopback sockets with a host id of its own (gloo on CPU for a dry run)."""
    import contextlib

    os.environ.update(env)
    res: dict = {"rank": rank, "cases": []}
    try:
        if dry_run:
            device, backend, gathers = "cpu", "gloo", _float8_gathers_on_gloo()
        else:
            os.environ.update(NCCL_HOSTID=f"compass-float8-rank{rank}", NCCL_IB_DISABLE="1",
                              NCCL_SOCKET_IFNAME="lo", NCCL_DEBUG=os.environ.get("NCCL_DEBUG", "WARN"))
            torch.cuda.set_device(0)
            device, backend, gathers = "cuda", "nccl", contextlib.nullcontext()
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
        with gathers:
            res = _outcome(rank, run_cases(rank, world, models, strategies, device, inductor_config))
    except Exception as e:  # noqa: BLE001 - the world's outcome
        res.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-1500:])
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(res, f)
    os._exit(0)  # NCCL's threads would keep the process


def on_existing_group(models: list[str], strategies: list[str], env: dict[str, str],
                      inductor_config: dict) -> list[dict]:
    """A dry run on the gloo group this process already belongs to (as the tests' rank pools call
    ``main``; ``launch.world_of_existing_group`` has checked it), instead of fresh processes: every
    rank's outcome, on every rank.  ``env`` is set for the run and put back after it (the process
    outlives the run)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = {k: os.environ.get(k) for k in env}  # only these: what the compiles set in the environment stays
    os.environ.update(env)
    try:
        with _float8_gathers_on_gloo():
            res = _outcome(rank, run_cases(rank, world, models, strategies, "cpu", inductor_config))
    except Exception as e:  # noqa: BLE001 - the world's outcome
        res = {"rank": rank, "cases": [], "status": "error", "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()[-1500:]}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    ranks: list = [None] * world
    dist.all_gather_object(ranks, res)
    return ranks


def markdown(payload: dict) -> str:
    lines = [f"# {NAME} ({payload['tag']})", "",
             "A float8 training step (forward and backward) on ranks sharing one GPU (each its own NCCL_HOSTID: "
             "NCCL's socket transport over loopback), eager against compiled with nothing rewritten (off) and "
             "with every pair decomposed in two parts; worst error: the largest difference over the tensor's largest magnitude, over the output, "
             "the input gradient and the weight gradients (rank 0; pass within 1e-2); SQNR: the lowest "
             "signal-to-quantization-noise ratio over those tensors (dB, torchao's measure); vs off: the "
             "same against the step compiled with nothing rewritten by the same compiler (off-eager for eager "
             "inner compilers and aot_eager, off-inductor for Inductor), which tells the rewrite's differences "
             "from those between eager and a compiled form.", ""]
    settings = [f"`{k}={v}` (environment)" for k, v in payload.get("env", {}).items()]
    settings += [f"`{k}={v!r}` (Inductor, while each step compiles and runs)"
                 for k, v in payload.get("inductor_config", {}).items()]
    if settings:
        lines += ["Settings: " + ", ".join(settings) + ".", ""]
    rows = [dict(world=w["world"], **c) for w in payload["worlds"] for c in w.get("cases", [])]
    lines.append(output.markdown_table(rows, ["world", "model", "strategy", "status", ("worst_error", "worst error"),
                                              ("sqnr_db", "SQNR dB"), ("status_vs_off", "vs off"),
                                              ("worst_vs_off", "worst vs off"), ("sqnr_vs_off_db", "SQNR vs off dB"),
                                              "pairs", "decomposed", ("backward_decomposed", "in backward"),
                                              "error"]))
    left = sorted({why for r in rows for why in r.get("not_rewritten", [])})
    if left:
        lines += ["", "Pairs not rewritten:", ""] + [f"* {why}" for why in left]
    errors = [f"* world {w['world']}: {w['error']}" for w in payload["worlds"] if w.get("error")]
    return "\n".join(lines + ([""] + errors if errors else []))


def _inductor_settings(p: argparse.ArgumentParser, items: list[str]) -> dict:
    """``NAME=VALUE`` items as Inductor settings (values read as Python literals), refused by the
    parser where Inductor has no such setting or a value is not a literal."""
    import ast

    import torch._inductor.config as inductor_config

    settings = {}
    for item in items:
        name, _, value = item.partition("=")
        if not hasattr(inductor_config, name):
            p.error(f"--inductor-config: Inductor has no setting {name!r}")
        try:
            settings[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            p.error(f"--inductor-config {item!r}: the value must be a Python literal (True, 0, 'x')")
    return settings


def main(argv=None) -> int:
    import importlib.util

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {list(MODELS)}")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"comma-separated, of {list(STRATEGIES) + list(TORCH_BACKENDS)} (torch-*: torch's backends)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set in every rank before its group starts (e.g. CUDA_LAUNCH_BLOCKING=1), recorded")
    p.add_argument("--inductor-config", action="append", default=[], metavar="NAME=VALUE",
                   help="an Inductor setting patched while each step compiles and runs (e.g. pattern_matcher=False: "
                        "its joint-graph rewrites), recorded")
    p.add_argument("--deadline", type=float, default=400.0, help="seconds a world may take before its ranks are killed")
    p.add_argument("--dry-run", action="store_true", help="CPU ranks over gloo, world 2, eager inner only")
    p.add_argument("--tag", default=None)
    p.add_argument("--out-dir", default=str(output.RESULTS))
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        p.error("float8_ranks needs a CUDA GPU (or --dry-run)")
    models = [m for m in args.models.split(",") if m]
    strategies = [s for s in args.strategies.split(",") if s]
    known = {**STRATEGIES, **TORCH_BACKENDS}
    if unknown := [m for m in models if m not in MODELS] + [s for s in strategies if s not in known]:
        p.error(f"unknown models or strategies: {unknown}")
    if importlib.util.find_spec("torchao") is None:
        skipped = [m for m in models if m.startswith("torchao")]
        models = [m for m in models if not m.startswith("torchao")]
        print(f"torchao is not installed: {skipped} left out", flush=True)
        if not models:
            p.error("torchao is not installed and only its models were asked for: nothing to run (its Python "
                    "source can be put on PYTHONPATH, as this script's docstring says)")
    env = dict(item.split("=", 1) for item in args.env)
    inductor_config = _inductor_settings(p, args.inductor_config)
    worlds_run = [2] if args.dry_run else [int(w) for w in args.worlds.split(",")]
    if args.dry_run:
        strategies = [s for s in strategies if s.endswith("eager")] if args.strategies == p.get_default("strategies") else strategies
    tag = args.tag or ("cpu" if args.dry_run else output.device_tag(False, 1).split("x")[0])
    worlds, t0 = [], time.time()
    if dist.is_initialized():  # a dry run on ranks that exist (the tests' pools): this group, as it is
        world = launch.world_of_existing_group(args, worlds_run)
        worlds.append(_world_row(world, on_existing_group(models, strategies, env, inductor_config), [], args.deadline))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for i, world in enumerate(worlds_run):
                ranks, killed = launch.fresh_ranks(worker, world, (models, strategies, args.dry_run, env,
                                                                   inductor_config), tmp, i, args.deadline)
                worlds.append(_world_row(world, ranks, killed, args.deadline))
    for row in worlds:
        print(f"world {row['world']}: {row['status']}" + (f" ({row['error'][:300]})" if "error" in row else ""),
              flush=True)
    status = 0 if all(w["status"] == "pass" for w in worlds) else 1
    if not launch.is_writer():
        return status
    payload = {"benchmark": NAME, "tag": tag, "models": models, "strategies": strategies, "env": env,
               "inductor_config": inductor_config, "worlds": worlds,
               "seconds": round(time.time() - t0, 1), "environment": output.environment(args.dry_run)}
    output.write_results(NAME, tag, payload, markdown(payload), args.out_dir)
    print(markdown(payload))
    return status


def _world_row(world: int, ranks: list[dict], killed: list[int], deadline_s: float) -> dict:
    """A world's row of the results: its outcome, rank 0's cases, each rank's status."""
    row = launch.world_outcome(world, ranks, killed, deadline_s)
    row.update(cases=ranks[0].get("cases", []), ranks=[{k: v for k, v in r.items() if k != "cases"} for r in ranks])
    return row


if __name__ == "__main__":
    sys.exit(main())
