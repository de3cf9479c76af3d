"""Train the demo Llama-style model with tensor + sequence parallelism on CPU ranks (gloo),
compiled with ``backend="compass"``, and check every step's loss against eager.

    python examples/train_tp.py                    # spawns 2 ranks itself
    torchrun --nproc-per-node 4 examples/train_tp.py --steps 5
"""
from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

import compass_fx
from compass_fx.demo import ModelArgs, Transformer, parallelize


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="ranks to spawn when not under torchrun")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--no-sequence-parallel", action="store_true")
    p.add_argument("--strategy", default="decompose", help="auto, off, decompose, fuse")
    p.add_argument("--chunks", type=int, default=2, help="InterDecom parts (0: left to the strategy)")
    p.add_argument("--inner", default="inductor", help="inductor or eager")
    return p.parse_args(argv)


def options_from(args: argparse.Namespace) -> dict:
    options = {"strategy": args.strategy, "inner": args.inner}
    if args.chunks and args.strategy in ("auto", "decompose"):
        options["chunks"] = args.chunks
    return options


def log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


@contextlib.contextmanager
def heartbeat(rank: int, what: str, every_s: float = 10.0):
    """Say every ``every_s`` seconds that ``what`` is still going, so a long compile is not silence."""
    done = threading.Event()
    t0 = time.perf_counter()

    def beat() -> None:
        while not done.wait(every_s):
            log(rank, f"  ... still {what} ({time.perf_counter() - t0:.0f}s)")

    thread = threading.Thread(target=beat, daemon=True)
    if rank == 0:
        thread.start()
    try:
        yield
    finally:
        done.set()


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    mesh = init_device_mesh("cpu", (world,))
    model_args = ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=8, vocab_size=512,
                           ffn_hidden=args.dim * 2)
    sp = not args.no_sequence_parallel

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return parallelize(Transformer(model_args), mesh, sequence_parallel=sp)

    eager, model = build(), build()
    compiled = torch.compile(model, backend="compass", options=options_from(args))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, model)]
    gen = torch.Generator().manual_seed(1)
    log(rank, f"world {world}, {'TP+SP' if sp else 'TP'}, {args.layers} layers, dim {args.dim}, "
              f"options {options_from(args)}")
    start = time.perf_counter()
    for step in range(args.steps):
        tokens = torch.randint(0, model_args.vocab_size, (args.batch, args.seq + 1), generator=gen)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        losses = []
        for net, fn, opt in ((eager, eager, opts[0]), (model, compiled, opts[1])):
            first_compile = step == 0 and fn is compiled
            if first_compile:
                log(rank, "compiling the forward and backward graphs with backend='compass' (Dynamo, "
                          "AOTAutograd, the compass pass, Inductor): about 40 s on 2 idle CPU cores ...")
            t0 = time.perf_counter()
            with heartbeat(rank, "compiling") if first_compile else contextlib.nullcontext():
                logits = fn(inputs)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append((loss.item(), time.perf_counter() - t0))
        (ref, t_ref), (got, t_got) = losses
        ok = abs(ref - got) <= 1e-4 * max(1.0, abs(ref))
        log(rank, f"step {step + 1}/{args.steps}  eager loss {ref:.6f} ({t_ref:.2f}s)  "
                  f"compass loss {got:.6f} ({t_got:.2f}s{', incl. compile' if step == 0 else ''})  "
                  f"{'match' if ok else 'MISMATCH'}")
        if not ok:
            raise SystemExit(f"rank {rank}: compiled loss {got} differs from eager {ref} at step {step + 1}")
        if step == 0:
            log(rank, "\nwhat compass_fx did:\n" + str(compass_fx.last_report()) + "\n")
    log(rank, f"done: {args.steps} steps, losses equal to eager, {time.perf_counter() - start:.1f}s")


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    # one gloo worker thread: torch's two corrupt the heap now and then under functional collectives
    with compass_fx.gloo_worker_threads(1):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        train(rank, world, args)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # under torchrun
        with compass_fx.gloo_worker_threads(1):
            dist.init_process_group("gloo")
        try:
            train(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"starting {args.world} CPU ranks (gloo); each imports torch and builds the model: about 10 s ...",
          flush=True)
    mp.spawn(_spawned, args=(args.world, port, args), nprocs=args.world, join=True)


if __name__ == "__main__":
    sys.exit(main())
