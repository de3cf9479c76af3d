"""A round of host-staged pulls as few copy-engine copies as its addresses allow (copy_runs)."""
import itertools

import pytest

from compass_fx.kernels import protocol as pr
from compass_fx.kernels.cuda.copy_runs import MAX_PITCH, Strided, strided
from compass_fx.kernels.issue_order import call_plans


def test_an_even_progression_is_one_copy_whatever_the_order_given():
    copies = [(1000 + 300 * i, 50_000 + 7000 * i, 200) for i in range(5)]
    for order in itertools.permutations(copies):
        assert strided(list(order)) == [Strided(1000, 50_000, 200, 5, 300, 7000)]


def test_a_break_in_the_progression_starts_another_copy():
    # the peers below and above this rank: sources at one stride, a gap where the own rank lies
    below = [(100 * i, 10_000 * i, 64) for i in range(2)]
    above = [(100 * i, 10_000 * i, 64) for i in range(3, 6)]
    assert strided(below + above) == [Strided(0, 0, 64, 2, 100, 10_000), Strided(300, 30_000, 64, 3, 100, 10_000)]


def test_copies_that_cannot_be_lines_of_one_stay_apart():
    assert strided([(0, 0, 64), (64, 100, 32)]) == [Strided(0, 0, 64), Strided(64, 100, 32)]  # sizes differ
    assert strided([(0, 0, 64), (32, 100, 64)]) == [Strided(0, 0, 64), Strided(32, 100, 64)]  # lines would overlap
    assert strided([(0, 0, 64), (100, 40, 64)]) == [Strided(0, 0, 64), Strided(100, 40, 64)]  # sources too
    far = MAX_PITCH + 1
    assert strided([(0, 0, 64), (100, far, 64)]) == [Strided(0, 0, 64), Strided(100, far, 64)]  # pitch too long
    assert strided([(5, 9, 64)]) == [Strided(5, 9, 64)]
    assert strided([]) == []


def test_every_byte_of_every_copy_is_moved_once():
    copies = [(1 << 20) * d + 7 * i for i, d in enumerate((3, 1, 4, 1, 5, 9, 2, 6))]
    copies = [(dst, 1_000_000 * i, 16) for i, dst in enumerate(copies)]
    moved = sorted((s.dst + line * s.dst_pitch, s.src + line * s.src_pitch)
                   for s in strided(copies) for line in range(s.height))
    assert moved == sorted((d, s) for d, s, _ in copies)


STRIDE, ROW = 1 << 30, 8192  # an arena region per rank, bytes per row


def _address(region: pr.Region, stage_rows: int) -> int:
    """Where the CUDA path puts a region (host_memory, impl): every rank's mirror one arena stride
    after the previous rank's; the staging slots one tensor; each call tensor a base of its own."""
    bases = {"HG": 1 << 20, "HP": 1 << 20, "GATHERED": 1 << 50, "OUT": 1 << 51, "STAGE": 1 << 52}
    base = bases[region.buf] + (region.owner * STRIDE if region.buf in ("HG", "HP") else 0)
    return base + (region.index * stage_rows + region.start) * ROW


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_a_host_staged_round_of_pulls_is_at_most_two_copies(world):
    """Every host-staged all-reduce's round pulls from all peers in one or two copies (the peers
    below the rank and those above it), at every rank, and so does every gather's round but the
    last, whose halves (drain_segments) are one or two copies each: what the replay graph's
    launch pays for now, instead of one copy per peer."""
    for op, rows in (("all_gather_matmul", 1024), ("matmul_all_reduce", 2048 * world)):
        for rank in range(world):
            plan = call_plans(op, "direct", world, rank, rows, 4096, 1, 2, True, piece_bytes=1 << 20)[0]
            runs = plan.copy_runs()
            pulls = [i for i, c in enumerate(plan.commands) if isinstance(c, pr.Copy) and c.src.owner != pr.SELF]
            if op == "matmul_all_reduce":
                assert [len(r) for r in runs] == ([world - 1] * (len(pulls) // (world - 1)) if world > 2 else [])
            else:
                parts = len(pulls) // (world - 1)
                last = [len(s) for s in pr.drain_segments(list(range(world - 1)))]
                assert parts > 1 and [len(r) for r in runs] == ([world - 1] * (parts - 1) + [n for n in last if n > 1]
                                                                if world > 2 else []), (world, rank, runs)
            for run in runs:
                cmds = [plan.commands[i] for i in run]
                lines = strided([(_address(c.dst, plan.stage_rows), _address(c.src, plan.stage_rows), c.dst.rows * ROW)
                                 for c in cmds])
                assert len(lines) <= 2 and sum(s.height for s in lines) == len(run), (op, world, rank, lines)
                if len(run) == world - 1:  # a whole round: two copies where the rank has peers on both sides
                    assert len(lines) == 1 + (rank not in (0, world - 1)), (op, world, rank, lines)


def test_the_last_round_of_a_gather_is_cut_in_halves_each_announced_once_copied():
    """After the last round's bytes arrive one piece's GEMM is left, not the round's (drain_segments):
    each half's arrivals are recorded right after its copies, before the next half is copied."""
    assert [len(s) for s in pr.drain_segments(list(range(7)))] == [4, 2, 1]
    assert [len(s) for s in pr.drain_segments(list(range(3)))] == [2, 1]
    assert pr.drain_segments([]) == [] and pr.drain_segments([5]) == [[5]]
    plan = call_plans("all_gather_matmul", "direct", 8, 3, 4096, 4096, 1, 2, True)[0]
    comm = [c for c in plan.commands if c.stream == pr.COMM]
    kinds = "".join({pr.WaitFlag: "w", pr.Copy: "c", pr.Record: "r"}.get(type(c), "") for c in comm)
    last = kinds[kinds.rindex("w") + 1:]  # after the last round's waits
    assert last.startswith("ccccrrrrccrrcr"), kinds


def test_pulls_that_wait_in_between_or_read_the_own_rank_make_no_run():
    """The peer transport's pulls each follow their own wait, the reduce-scatter's too, and a copy
    of the rank's own rows is no pull: no runs."""
    for op in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
        assert call_plans(op, "direct", 8, 3, 4096, 4096, 1, 2, False)[0].copy_runs() == ()
    assert call_plans("matmul_reduce_scatter", "direct", 8, 3, 8192, 4096, 1, 2, True)[0].copy_runs() == ()
    c = pr.Copy(pr.COMM, pr.Region("OUT", 0, 4), pr.Region("HP", 0, 4, owner=1))
    own = pr.Copy(pr.COMM, pr.Region("OUT", 4, 8), pr.Region("HP", 4, 8))
    other_size = pr.Copy(pr.COMM, pr.Region("OUT", 8, 10), pr.Region("HP", 8, 10, owner=2))
    plan = pr.Plan("toy", 0, 3, (c, c, own, c, other_size, c, c, pr.Record(pr.COMM, "x"), c), 1)
    assert plan.copy_runs() == ((0, 1), (5, 6))


def test_the_2d_copy_parameters_are_laid_out_as_the_driver_reads_them():
    """``CUDA_MEMCPY2D`` (cuda.h): the source's seven fields, the destination's, then width and
    height; an enum padded to eight bytes before the pointers."""
    import ctypes

    from compass_fx.kernels.cuda.driver import _Memcpy2D

    assert ctypes.sizeof(_Memcpy2D) == 128
    offsets = {name: getattr(_Memcpy2D, name).offset for name, _ in _Memcpy2D._fields_}
    assert offsets["srcMemoryType"] == 16 and offsets["srcDevice"] == 32 and offsets["srcPitch"] == 48
    assert offsets["dstXInBytes"] == 56 and offsets["dstDevice"] == 88 and offsets["dstPitch"] == 104
    assert offsets["WidthInBytes"] == 112 and offsets["Height"] == 120


@pytest.mark.parametrize("world", [4, 8])
def test_the_models_count_of_a_replays_slow_nodes_is_the_slowest_ranks(world):
    """The cost model prices a fused call's replay from rank 0's plan, each run of pulls as at most
    two copies (``strategies.replay_slow_nodes``); the ranks' replays launch their own graphs and the
    slowest sets the pace.  Counted exactly (each rank's runs as the 2D copies their addresses
    make), the model's count is the slowest rank's, or one node over it (the eight-rank gather's
    last round in halves: a rank whose peers wrap around pays the second copy in one half only)."""
    from compass_fx.cost.strategies import replay_slow_nodes

    for op, rows in (("all_gather_matmul", 1024), ("all_gather_matmul", 4096), ("matmul_all_reduce", 2048 * world)):
        exact = []
        for rank in range(world):
            plan = call_plans(op, "direct", world, rank, rows, 4096, 1, 2, True)[0]
            over = 0
            for run in plan.copy_runs():
                cmds = [plan.commands[i] for i in run]
                lines = strided([(_address(c.dst, plan.stage_rows), _address(c.src, plan.stage_rows), c.dst.rows * ROW)
                                 for c in cmds])
                over += len(lines) - min(2, len(run))
            exact.append(replay_slow_nodes(plan, True) + over)
        model = replay_slow_nodes(call_plans(op, "direct", world, 0, rows, 4096, 1, 2, True)[0], True)
        assert max(exact) <= model <= max(exact) + 1, (op, rows, model, exact)
        assert exact[0] < model  # rank 0's own pulls never wrap: one copy per run
