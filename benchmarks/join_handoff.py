"""What c10d's hand-off of a deferred call's join costs the host, on this machine's CPU (no GPU).

A deferred fused call (fused_async's ``*_start``) registers a c10d ``Work`` for its output, and the
graph's ``_c10d_functional.wait_tensor`` takes it back and waits for it
(``kernels/cuda/impl._register_join``).  On an H100's host that hand-off costs 14-24 us of a
deferred call's 52-108 (``fused_host_time --deferred-parts``).  Before anyone rewrites it, this
says which part of it any rewrite can save: in one process, the forms taking turns, the median of
rounds, each form's host microseconds per call:

* ``python work``: the hand-off as the code does it, a ``JoinWork`` (a Python subclass of
  ``Work``) registered for a tensor, then ``wait_tensor`` on it (its join waits for nothing);
* ``C++ work``: the same with a ``Work`` written in C++ (built here by torch's cpp_extension, a
  minute): no conversion of a Python object at the registration, no call back into Python at
  the wait (what a join kept in C would cost);
* ``wait_tensor``: ``wait_tensor`` alone, nothing registered; ``below autograd``: the same inside
  ``torch._C._AutoDispatchBelowAutograd`` (torch registers a Python autograd wrapper for
  ``_c10d_functional::wait_tensor`` that every other call runs: a cost no join can avoid while
  the graphs wait through ``wait_tensor``).

    python benchmarks/join_handoff.py              # writes results/join_handoff/join_handoff-cpu.{json,md}
    python benchmarks/join_handoff.py --no-cpp     # without the C++ work (no compiler needed)
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import output  # noqa: E402  (sets the no-multicast environment first)
from harness.timing import host_us_per_call  # noqa: E402
import torch  # noqa: E402

NAME = "join_handoff"

_CPP_WORK = r"""
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>  // c10d::register_work

struct WaitsForNothing : c10d::Work {
  bool wait(std::chrono::milliseconds) override { return true; }
};

void register_cpp_work(const at::Tensor& tensor) {
  c10d::register_work(tensor, c10::make_intrusive<WaitsForNothing>());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("register_cpp_work", &register_cpp_work); }
"""


class _NoJoin:
    """A join with nothing to wait for: the hand-off timed alone."""

    def wait(self) -> None:
        pass


def hand_off(held: torch.Tensor):
    """A call that hands a join over as ``impl._register_join`` does (a Python ``Work`` registered for
    ``held``) and takes it back with ``wait_tensor``, as a rewritten graph's wait does; the join waits
    for nothing.  (fused_host_time's ``--deferred-parts`` times it on a GPU's host too.)"""
    from compass_fx.kernels.cuda import impl

    nothing, wait = _NoJoin(), torch.ops._c10d_functional.wait_tensor.default

    def handed_off():
        impl._register_join(held, nothing)
        return wait(held)

    return handed_off


def forms(cpp: bool) -> dict:
    """The forms timed, by name: each a call (one hand-off or one wait on a one-element CPU tensor)
    and what its rounds run inside (the guard below autograd is entered once a round, not per call)."""
    held = torch.empty(1)
    wait = torch.ops._c10d_functional.wait_tensor.default
    timed = {"python_work_us": (hand_off(held), contextlib.nullcontext),
             "wait_tensor_us": (lambda: wait(held), contextlib.nullcontext),
             "wait_below_autograd_us": (lambda: wait(held), torch._C._AutoDispatchBelowAutograd)}
    if cpp:
        from torch.utils.cpp_extension import load_inline

        register = load_inline("compass_join_handoff", cpp_sources=[_CPP_WORK], extra_cflags=["-O2"]).register_cpp_work

        def cpp_work():
            register(held)
            wait(held)

        timed["cpp_work_us"] = (cpp_work, contextlib.nullcontext)
    return timed


def measure(timed: dict, calls: int, rounds: int) -> dict[str, float]:
    """Per form, the median over ``rounds`` of the microseconds per call of ``calls`` calls."""
    per_round: dict[str, list[float]] = {name: [] for name in timed}
    for turn in range(rounds + 1):  # the first round warms
        for name, (fn, inside) in timed.items():
            with inside():
                us = host_us_per_call(fn, calls)
            if turn:
                per_round[name].append(us)
    return {name: statistics.median(v) for name, v in per_round.items()}


def markdown(payload: dict) -> str:
    got = payload["us"]
    lines = [f"# {NAME} ({payload['tag']})", "",
             "c10d's hand-off of a deferred call's join on this machine's CPU, host microseconds per call (median "
             f"of {payload['rounds']} rounds of {payload['calls']} calls, the forms in turns): a Python `Work` "
             "registered then taken back by `wait_tensor` (as `impl._register_join` does), the same with a C++ "
             "`Work`, `wait_tensor` alone and below autograd.", "",
             output.markdown_table([{"form": k.removesuffix("_us").replace("_", " "), "us": v} for k, v in got.items()],
                                   ["form", "us"]), ""]
    if "cpp_work_us" in got:
        lines.append(f"A join kept in C would save {got['python_work_us'] - got['cpp_work_us']:.1f} us of the "
                     f"{got['python_work_us']:.1f}; torch's autograd wrapper around `wait_tensor` costs "
                     f"{got['wait_tensor_us'] - got['wait_below_autograd_us']:.1f} us of every call.")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-cpp", action="store_true", help="leave the C++ work out (nothing built)")
    p.add_argument("--calls", type=int, default=2000, help="calls per round and form")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out-dir", default=str(output.RESULTS))
    args = p.parse_args(argv)
    if args.calls < 1 or args.rounds < 1:
        p.error("--calls and --rounds must be positive")
    payload = {"benchmark": NAME, "tag": args.tag, "calls": args.calls, "rounds": args.rounds,
               "us": measure(forms(not args.no_cpp), args.calls, args.rounds), "environment": output.environment(False)}
    text = markdown(payload)
    print(text)
    output.write_results(NAME, args.tag, payload, text, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
