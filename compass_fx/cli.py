"""The ``compass-fx`` command: ``explain`` the demo model, and the planning subcommands.

    compass-fx explain --world 4 --chunks 2      # what the backend does to the demo TP model
    compass-fx plan --model llama3-70b --tp 8 --tokens 8192 --topology a6000-nvlink-pairs-pcie-8
    compass-fx sweep --out-dir compass-sweep     # the 288-configuration planning grid
    compass-fx prepare                           # build the fused calls' host fast path ahead

Every error is one line on stderr (``compass-fx <command>: error: ...``); ``--debug`` shows the
traceback instead.  Exit status: 0 done; 1 an unexpected internal error; 2 bad usage or input
(an option, a value, a topology file's content, a missing GPU); 3 a file or directory that cannot
be read or written; 4 a missing optional dependency.
"""
from __future__ import annotations

import argparse
import difflib
import sys
from typing import Sequence

from .cli_args import positive_int, require_multiple

EXIT_OK, EXIT_INTERNAL, EXIT_USAGE, EXIT_FILE, EXIT_DEPENDENCY = 0, 1, 2, 3, 4


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the usage block is one ``--help`` away, not in every error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (usage: {self.prog} --help)\n")


def cmd_explain(args: argparse.Namespace) -> int:
    """Trace the demo Llama-style model on a fake process group and print the report."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import compass_fx
    from compass_fx.demo import ModelArgs, Transformer, parallelize

    options = {"strategy": args.strategy, "topology": args.topology}
    if args.chunks is not None:
        options["chunks"] = args.chunks
    if args.schedule is not None:
        options["schedule"] = args.schedule
    if args.mode is not None:
        options["mode"] = args.mode
    if args.fused_async:
        options["fused_async"] = True
    compass_fx.check_options(options)  # a bad value fails here, before any tracing
    check_demo_shape(args)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    try:
        mesh = init_device_mesh("cpu", (args.world,))
        torch.manual_seed(0)
        model_args = ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                               ffn_hidden=args.ffn_hidden, vocab_size=args.vocab)
        model = parallelize(Transformer(model_args), mesh, sequence_parallel=not args.no_sequence_parallel)
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq))
        report = compass_fx.explain(model, tokens, **options)
    finally:
        dist.destroy_process_group()
    print(report.to_json() if args.json else report.format(every_pair=args.every_pair))
    return 0


def check_demo_shape(args: argparse.Namespace) -> None:
    """The demo model's sizes must shard evenly over --world; say which flag, not a Dynamo traceback."""
    if not args.no_sequence_parallel:
        require_multiple("--seq", args.seq, "--world", args.world, " with sequence parallelism")
    require_multiple("--heads", args.heads, "--world", args.world)
    require_multiple("--dim", args.dim, "--heads", args.heads)
    require_multiple("--ffn-hidden", args.ffn_hidden, "--world", args.world)


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False everywhere: "sweep --out x" must be an error, not a silent "--out-dir x".
    parser = _Parser(prog="compass-fx", description=__doc__, allow_abbrev=False,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("explain", help="show which matmul<->collective pairs the backend rewrites in the demo model",
                        allow_abbrev=False)
    ex.add_argument("--world", type=positive_int, default=4, help="tensor-parallel group size (fake ranks)")
    ex.add_argument("--layers", type=positive_int, default=2)
    ex.add_argument("--dim", type=positive_int, default=256)
    ex.add_argument("--heads", type=positive_int, default=8)
    ex.add_argument("--ffn-hidden", type=positive_int, default=512)
    ex.add_argument("--vocab", type=positive_int, default=1024)
    ex.add_argument("--batch", type=positive_int, default=2)
    ex.add_argument("--seq", type=positive_int, default=64)
    ex.add_argument("--no-sequence-parallel", action="store_true", help="plain TP (all_reduce pairs)")
    ex.add_argument("--strategy", default="auto", help="auto, off, decompose or fuse")
    ex.add_argument("--chunks", type=positive_int, default=None, help="force the InterDecom part count")
    ex.add_argument("--schedule", default=None, help="fused schedule: ring, double_ring, direct")
    ex.add_argument("--topology", default=None, help="topology preset name or file for the cost model")
    ex.add_argument("--mode", default=None,
                    help="Inductor mode the model would compile under (reduce-overhead: priced as CUDA graph replays)")
    ex.add_argument("--fused-async", action="store_true",
                    help="the fused_async option: fused reductions start early and are waited for at first use "
                         "(where work lies between), priced so")
    ex.add_argument("--json", action="store_true", help="print the report as JSON")
    ex.add_argument("--every-pair", action="store_true",
                    help="a table row per pair (by default pairs alike, a layer's repeated, share a row with their count)")
    ex.set_defaults(func=cmd_explain)
    from .tools.commands import add_subcommands

    add_subcommands(sub)
    for command in sub.choices.values():
        command.set_defaults(command_parser=command)  # main reports a late ValueError through it
        command.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; any error is one line on stderr and an exit status (module docstring)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}{_suggestion(unknown, args.command_parser)}")
    try:
        return args.func(args)
    except Exception as e:  # noqa: BLE001 - every failure becomes one line, unless --debug
        if args.debug:
            raise
        status, message = describe_error(e)
        print(f"{args.command_parser.prog}: error: {message}", file=sys.stderr)
        return status


def describe_error(e: BaseException) -> tuple[int, str]:
    """The exit status and the one-line message for an error a subcommand raised."""
    if isinstance(e, OSError) and e.filename is not None:
        return EXIT_FILE, f"cannot use {e.filename}: {e.strerror or e}"
    if isinstance(e, OSError):
        return EXIT_FILE, str(e)
    if isinstance(e, ImportError):
        return EXIT_DEPENDENCY, str(e)
    if isinstance(e, (ValueError, argparse.ArgumentTypeError)):
        return EXIT_USAGE, str(e).replace("\n", "; ")
    first = str(e).splitlines()[0] if str(e) else ""
    return EXIT_INTERNAL, f"internal error ({type(e).__name__}: {first}); rerun with --debug for the traceback"


def _suggestion(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """" (did you mean --out-dir?)" for an option that is close to one of ``parser``'s, else ""."""
    known = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    for arg in unknown:
        if arg.startswith("--"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], known, n=1, cutoff=0.6)
            if close:
                return f" (did you mean {close[0]}?)"
    return ""


if __name__ == "__main__":
    sys.exit(main())
