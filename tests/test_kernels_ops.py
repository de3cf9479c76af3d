"""The compass:: fused operators on real gloo process groups against torch.distributed + torch.mm."""
import os
from unittest import mock

import pytest
import torch

import compass_fx.kernels  # noqa: F401  (registers torch.ops.compass)
from compass_fx.kernels import SCHEDULES, fused_schedules_available

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=5e-2)}


def _inputs(rank, seed, shape, dtype):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(shape, generator=g).to(dtype)


def _group():
    import torch.distributed as dist

    pg = dist.group.WORLD
    return pg.group_name, dist.get_world_size()


def _all_gather(x):
    import torch.distributed as dist

    out = x.new_empty((x.shape[0] * dist.get_world_size(), *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous())
    return out


def _reduce_scatter(x):
    import torch.distributed as dist

    out = x.new_empty((x.shape[0] // dist.get_world_size(), *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous())
    return out


def _forward_case(rank, schedule, dtype, m, k, ns):
    """Forward of all three ops against the collectives; returns the max errors seen."""
    import torch.distributed as dist

    name, w = _group()
    a_shard = _inputs(rank, 1, (m, k), dtype)
    bs = [_inputs(rank, 2 + j, (k, n), dtype) for j, n in enumerate(ns)]
    # weights stored [N, K] and used transposed, as nn.Linear does
    bs[-1] = bs[-1].t().contiguous().t()
    gathered, outs = torch.ops.compass.all_gather_matmul(a_shard, bs, schedule, name, w)
    ref_g = _all_gather(a_shard)
    assert torch.equal(gathered, ref_g)
    for out, b in zip(outs, bs):
        torch.testing.assert_close(out, ref_g @ b, **TOL[dtype])

    a = _inputs(rank, 7, (m * w, k), dtype)
    b = _inputs(rank, 8, (k, ns[0]), dtype)
    rs = torch.ops.compass.matmul_reduce_scatter(a, b, schedule, name, w)
    ref = (a.float() @ b.float())
    torch.testing.assert_close(rs.float(), _reduce_scatter(ref), **TOL[dtype])

    # all-reduce, also with rows that do not divide by the world size
    for rows in (m * w, m * w + 1):
        a = _inputs(rank, 9, (rows, k), dtype)
        ar = torch.ops.compass.matmul_all_reduce(a, b, schedule, name, w)
        ref = a.float() @ b.float()
        dist.all_reduce(ref)
        torch.testing.assert_close(ar.float(), ref, **TOL[dtype])
        assert ar.dtype == dtype and ar.shape == (rows, ns[0])
    return True


def _backward_case(rank, schedule):
    name, w = _group()
    m, k, n1, n2 = 3, 5, 4, 6
    a_shard = _inputs(rank, 11, (m, k), torch.float64).requires_grad_()
    b1 = _inputs(rank, 12, (k, n1), torch.float64).requires_grad_()
    b2 = _inputs(rank, 13, (k, n2), torch.float64).requires_grad_()
    g1, g2 = _inputs(rank, 14, (m * w, n1), torch.float64), _inputs(rank, 15, (m * w, n2), torch.float64)
    gg = _inputs(rank, 16, (m * w, k), torch.float64)
    gathered, (o1, o2) = torch.ops.compass.all_gather_matmul(a_shard, [b1, b2], schedule, name, w)
    ((o1 * g1).sum() + (o2 * g2).sum() + (gathered * gg).sum()).backward()
    ref_g = _all_gather(a_shard.detach())
    torch.testing.assert_close(a_shard.grad, _reduce_scatter(g1 @ b1.detach().t() + g2 @ b2.detach().t() + gg))
    torch.testing.assert_close(b1.grad, ref_g.t() @ g1)
    torch.testing.assert_close(b2.grad, ref_g.t() @ g2)

    a = _inputs(rank, 17, (m * w, k), torch.float64).requires_grad_()
    b = _inputs(rank, 18, (k, n1), torch.float64).requires_grad_()
    g = _inputs(rank, 19, (m, n1), torch.float64)
    (torch.ops.compass.matmul_reduce_scatter(a, b, schedule, name, w) * g).sum().backward()
    full_g = _all_gather(g)
    torch.testing.assert_close(a.grad, full_g @ b.detach().t())
    torch.testing.assert_close(b.grad, a.detach().t() @ full_g)

    a.grad = b.grad = None
    g = _inputs(0, 20, (m * w, n1), torch.float64)  # replicated gradient, as after a replicated loss
    (torch.ops.compass.matmul_all_reduce(a, b, schedule, name, w) * g).sum().backward()
    torch.testing.assert_close(a.grad, g @ b.detach().t())
    torch.testing.assert_close(b.grad, a.detach().t() @ g)
    return True


def _errors_case(rank):
    name, w = _group()
    a, b = torch.randn(2 * w, 3), torch.randn(3, 4)
    for bad in ("tree", "Ring", ""):
        with pytest.raises(ValueError, match="schedule"):
            torch.ops.compass.matmul_reduce_scatter(a, b, bad, name, w)
    with pytest.raises(ValueError, match="group_size"):
        torch.ops.compass.matmul_all_reduce(a, b, "ring", name, w + 1)
    with pytest.raises(ValueError, match="divisible"):
        torch.ops.compass.matmul_reduce_scatter(a[:-1], b, "ring", name, w)
    return True


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_forward_matches_collectives(ranks, world, schedule):
    # m=5 makes the double ring's halves uneven (3 + 2 rows)
    assert ranks(world).run(_forward_case, schedule, torch.float32, 5, 8, (6, 7)) == [True] * world
    assert ranks(world).run(_forward_case, schedule, torch.bfloat16, 4, 16, (8,)) == [True] * world


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_single_row_shards(ranks, world):
    """Shards of one row: the double ring's second half is empty and must be skipped consistently."""
    for schedule in SCHEDULES:
        assert ranks(world).run(_forward_case, schedule, torch.float32, 1, 4, (3,)) == [True] * world


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_backward_matches_adjoint(ranks, schedule):
    assert ranks(2).run(_backward_case, schedule) == [True, True]


def test_bad_arguments(ranks):
    assert ranks(2).run(_errors_case) == [True, True]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_world_size_one_without_process_group(schedule):
    a, b1, b2 = torch.randn(6, 4), torch.randn(4, 3), torch.randn(4, 5)
    gathered, (o1, o2) = torch.ops.compass.all_gather_matmul(a, [b1, b2], schedule, "0", 1)
    assert torch.equal(gathered, a) and gathered.data_ptr() != a.data_ptr()
    torch.testing.assert_close(o1, a @ b1)
    torch.testing.assert_close(o2, a @ b2)
    torch.testing.assert_close(torch.ops.compass.matmul_reduce_scatter(a, b1, schedule, "0", 1), a @ b1)
    torch.testing.assert_close(torch.ops.compass.matmul_all_reduce(a, b1, schedule, "0", 1), a @ b1)
    # backward through all three ops, no process group at all
    x, w = a.clone().requires_grad_(), b1.clone().requires_grad_()
    g, (o,) = torch.ops.compass.all_gather_matmul(x, [w], schedule, "0", 1)
    loss = (o.sum() + g.sum() + torch.ops.compass.matmul_reduce_scatter(x, w, schedule, "0", 1).sum()
            + torch.ops.compass.matmul_all_reduce(x, w, schedule, "0", 1).sum())
    loss.backward()
    x2, w2 = a.clone().requires_grad_(), b1.clone().requires_grad_()
    (3 * (x2 @ w2).sum() + x2.sum()).backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


def test_opcheck_and_fake_shapes():
    a, b = torch.randn(8, 4), torch.randn(4, 3)
    ops = torch.ops.compass
    for packet, args in ((ops.all_gather_matmul, (a, [b, b], "ring", "0", 1)),
                         (ops.matmul_reduce_scatter, (a, b, "double_ring", "0", 1)),
                         (ops.matmul_all_reduce, (a, b, "direct", "0", 1))):
        for op in (packet.default, packet.graph):  # the autograd-capable op and what rewritten graphs call
            torch.library.opcheck(op, args)
    for op in (ops.matmul_reduce_scatter_start.default, ops.matmul_all_reduce_start.default):
        torch.library.opcheck(op, (a, b, "ring", "0", 1))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fa, fb = torch.empty(8, 4), torch.empty(4, 3)
        g, (o,) = torch.ops.compass.all_gather_matmul(fa, [fb], "ring", "0", 4)
        assert g.shape == (32, 4) and o.shape == (32, 3)
        assert torch.ops.compass.matmul_reduce_scatter(fa, fb, "ring", "0", 4).shape == (2, 3)
        assert torch.ops.compass.matmul_all_reduce(fa, fb, "ring", "0", 4).shape == (8, 3)


def test_schedules_available():
    assert fused_schedules_available("cpu", torch.float32) == SCHEDULES
    assert fused_schedules_available("cpu", torch.int64) == ()
    assert fused_schedules_available("xla", torch.float32) == ()


def test_schedules_available_cuda_p2p_valve(monkeypatch):
    monkeypatch.setenv("COMPASS_CUDA_FUSED", "p2p")
    assert fused_schedules_available("cuda", torch.bfloat16) == SCHEDULES
    assert fused_schedules_available("cuda", torch.int32) == ()


def test_fused_ops_are_kept_out_of_cuda_graphs():
    """A captured call needs its twin workspace (``COMPASS_FUSED_GRAPHS=1``, built by an eager call
    first), which Inductor's CUDA graphs know nothing of, so Inductor must not put them in a CUDA
    graph: every op carries the cudagraph_unsafe tag where torch has it."""
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    if tag is None:
        pytest.skip("this torch has no cudagraph_unsafe tag")
    for name in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
        assert tag in getattr(torch.ops.compass, name).default.tags, name


def _arena_case(rank):
    """Each rank writes its region; every rank reads every region; the files are gone."""
    import glob

    import torch.distributed as dist

    from compass_fx.kernels.cuda.host_memory import Layout, SharedHostArena

    layout = Layout()
    layout.add("flags", 4 * 5)
    layout.add("G", 2 * 3 * 7 * 2)
    before = set(glob.glob("/dev/shm/compass-fx-*"))
    arena = SharedHostArena(dist.group.WORLD, layout.nbytes)
    world = dist.get_world_size()
    dist.barrier()  # every rank has unlinked its file
    left = set(glob.glob("/dev/shm/compass-fx-*")) - before
    own = arena.view(rank, layout.offsets["G"], (2, 3, 7), torch.bfloat16)
    own.copy_(torch.full((2, 3, 7), float(rank + 1)))
    arena.view(rank, layout.offsets["flags"], (5,), torch.int32)[2] = 10 + rank
    dist.barrier()
    for peer in range(world):
        g = arena.view(peer, layout.offsets["G"], (2, 3, 7), torch.bfloat16)
        assert bool((g == peer + 1).all()), (rank, peer)
        assert int(arena.view(peer, layout.offsets["flags"], (5,), torch.int32)[2]) == 10 + peer
        assert arena.device_address(peer, 8) == arena.view(peer, 0, (1,), torch.uint8).data_ptr() + 8
        # one stride from each rank's region to the next: a round of pulls is one 2D copy (copy_runs)
        assert arena.device_address(peer) == arena.device_address(0) + peer * arena.stride
    with pytest.raises(ValueError, match="does not fit"):
        arena.view(rank, layout.nbytes - 2, (4,), torch.int32)
    dist.barrier()  # nobody unmaps while a peer still reads
    assert not left, f"the arena left files behind: {left}"
    return True


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3: a pool of its own
def test_shared_host_arena_on_real_ranks(ranks, world):
    """The memory host-staged fused operators meet in: every rank's region visible to all."""
    assert ranks(world).run(_arena_case) == [True] * world


def _agreement_case(rank):
    """Settings the peers address each other's buffers by: the same on every rank passes, a
    difference is an error naming the setting on every rank (never a silent mismatch)."""
    import torch.distributed as dist

    from compass_fx.kernels.cuda.impl import _agreed, _agreed_graph_guards, _agreed_transport

    group = dist.group.WORLD
    assert _agreed(group, 2, "buffer sets in CUDA graphs", "COMPASS_FUSED_GRAPH_BUFFERS") == 2
    with pytest.raises(RuntimeError, match=r"disagree on the fused operators' buffer sets in CUDA graphs "
                                           r"\(\[1, 2\]\): set COMPASS_FUSED_GRAPH_BUFFERS alike"):
        _agreed(group, 1 + rank, "buffer sets in CUDA graphs", "COMPASS_FUSED_GRAPH_BUFFERS")
    # host-staged ranks must cut blocks alike: a piece count set on one rank only is an error
    with mock.patch.dict(os.environ, {"COMPASS_FUSED_TRANSPORT": "host"}):
        assert _agreed_transport(group) == "host"
        os.environ["COMPASS_HOST_MOST_PIECES"] = str(2 + 2 * rank)
        with pytest.raises(RuntimeError, match=r"disagree on the fused operators' transport and host-staged "
                                               r"pieces .*COMPASS_HOST_MOST_PIECES"):
            _agreed_transport(group)
    # graphs' guards from one global order: the sequence chosen on one rank only is an error
    with mock.patch.dict(os.environ, {"COMPASS_GRAPH_GUARD_SEQUENCE": "capture"}):
        assert _agreed_graph_guards(group) == (True, False)
        os.environ["COMPASS_GRAPH_GUARD_SEQUENCE"] = ("capture", "sets-last")[rank]
        with pytest.raises(RuntimeError, match=r"disagree on the fused operators' CUDA graph guards .*"
                                               r"COMPASS_GRAPH_GUARD_SEQUENCE"):
            _agreed_graph_guards(group)
    return True


def test_ranks_agree_on_the_settings_that_lay_out_buffers(ranks, monkeypatch):
    from compass_fx.kernels.cuda import graph_buffer_sets

    assert ranks(2).run(_agreement_case) == [True, True]
    monkeypatch.delenv("COMPASS_FUSED_GRAPH_BUFFERS", raising=False)
    assert graph_buffer_sets() == 1
    monkeypatch.setenv("COMPASS_FUSED_GRAPH_BUFFERS", "2")
    assert graph_buffer_sets() == 2
    monkeypatch.setenv("COMPASS_FUSED_GRAPH_BUFFERS", "3")
    with pytest.raises(ValueError, match="COMPASS_FUSED_GRAPH_BUFFERS must be 1 or 2"):
        graph_buffer_sets()


def test_host_most_pieces_setting(monkeypatch):
    from compass_fx.kernels.cuda.impl import host_most_pieces_setting

    monkeypatch.delenv("COMPASS_HOST_MOST_PIECES", raising=False)
    assert host_most_pieces_setting() == 0  # by the number of ranks
    monkeypatch.setenv("COMPASS_HOST_MOST_PIECES", "8")
    assert host_most_pieces_setting() == 8
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv("COMPASS_HOST_MOST_PIECES", bad)
        with pytest.raises(ValueError, match="COMPASS_HOST_MOST_PIECES must be a positive integer"):
            host_most_pieces_setting()


def test_transport_choice(monkeypatch):
    from compass_fx.kernels.cuda.impl import transport

    monkeypatch.delenv("COMPASS_FUSED_TRANSPORT", raising=False)
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    assert transport() == "host"
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0")
    assert transport() == "peer"
    monkeypatch.setenv("COMPASS_FUSED_TRANSPORT", "host")
    assert transport() == "host"
    monkeypatch.setenv("COMPASS_FUSED_TRANSPORT", "nvlink")
    with pytest.raises(ValueError, match="auto, peer or host"):
        transport()


def test_graph_guard_sequence_setting_picks_the_graphs_guards(monkeypatch):
    """``COMPASS_GRAPH_GUARD_SEQUENCE`` reaches the plans a workspace's CUDA graphs capture: the
    default guards from the capture order, ``sets-last`` from graph_order.guard_sequence (a guard
    per pull, each on its matching publication, where the capture order's few guards are on late
    ones), anything else an error."""
    from compass_fx.kernels.cuda.impl import _plans
    from compass_fx.kernels.graph_order import GUARD_EVENT, graph_plans
    from compass_fx.kernels.issue_order import call_plans

    args = ("matmul_reduce_scatter", "direct", 4, 1, 8192, 4096, 1, 2, True)

    def guard_waits(plans) -> int:
        return sum(type(c).__name__ == "WaitEvent" and c.event.startswith(GUARD_EVENT) for c in plans[0].commands)

    monkeypatch.delenv("COMPASS_GRAPH_GUARD_SEQUENCE", raising=False)
    assert _plans(False) is call_plans
    default = _plans(True)(*args)
    assert default == graph_plans(*args)
    monkeypatch.setenv("COMPASS_GRAPH_GUARD_SEQUENCE", "sets-last")
    fewer = _plans(True)(*args)
    assert fewer == graph_plans(*args, sets_last=True) != default
    assert guard_waits(fewer) > guard_waits(default)  # one guard per pull, each on an earlier publication
    monkeypatch.setenv("COMPASS_GRAPH_GUARD_SEQUENCE", "fewest")
    with pytest.raises(ValueError, match="COMPASS_GRAPH_GUARD_SEQUENCE must be sets-last or capture"):
        _plans(True)


def test_cuda_kernels_go_straight_to_the_dispatcher():
    """The CUDA kernels are registered with the dispatcher directly, not through the custom op's
    kernel wrapper, which cost a median 25 us of host time per call (``ops._cuda_kernel``)."""
    for name in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce",
                 "matmul_reduce_scatter_start", "matmul_all_reduce_start", "all_gather_matmul.graph",
                 "matmul_reduce_scatter.graph", "matmul_all_reduce.graph"):
        table = torch._C._dispatch_dump(f"compass::{name}")
        (cuda,) = [line for line in table.splitlines() if line.startswith("CUDA:")]
        assert "compass_fx/kernels/ops.py" in cuda.replace("\\", "/"), cuda


def test_the_host_fast_paths_exist_on_this_torch():
    """A fused call's host cost rests on private torch functions that are looked up with a fallback
    (a torch without them still runs the calls, each some 1-30 us slower: ``ops._direct``,
    ``impl._capturing``, ``impl._raw_stream``), so a torch that drops one slows every call
    silently; here it fails instead.  Checked present in torch 2.13.0 (CPU) and 2.14.1 (CUDA)."""
    from compass_fx.kernels import ops as ops_module
    from compass_fx.kernels.cuda import impl

    assert ops_module._direct_possible()
    for name in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
        assert hasattr(getattr(torch.ops.compass, name).graph._op, "through_dispatcher"), name
    for name in ("matmul_reduce_scatter_start", "matmul_all_reduce_start"):  # fused_async's calls too
        start = getattr(torch.ops.compass, name).default
        assert hasattr(start._op, "through_dispatcher"), name
        a, b = torch.randn(6, 5, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
        torch.testing.assert_close(start(a, b, "direct", "0", 1), a @ b)  # not CUDA: the dispatcher's kernel
    assert impl._capturing is torch._C._cuda_isCurrentStreamCapturing
    if torch.version.cuda is not None:  # a CPU build has no CUDA stream functions at all
        assert impl._raw_stream is torch._C._cuda_getCurrentRawStream


def test_a_deferred_calls_join_runs_once_at_its_wait_tensor():
    """A deferred call's result carries its join as a c10d work (``impl._register_join``):
    ``_c10d_functional.wait_tensor`` on it runs that join once, and each result its own (the work's
    class is made once, not per call)."""
    from compass_fx.kernels.cuda import impl

    class Join:
        def __init__(self) -> None:
            self.waits = 0

        def wait(self) -> None:
            self.waits += 1

    first, second = Join(), Join()
    x, y = torch.zeros(3), torch.ones(2)
    impl._register_join(x, first)
    impl._register_join(y, second)
    wait = torch.ops._c10d_functional.wait_tensor
    torch.testing.assert_close(wait(y), torch.ones(2))
    assert (first.waits, second.waits) == (0, 1)
    wait(x)
    wait(x)  # waited for already: nothing registered any more
    assert (first.waits, second.waits) == (1, 1)
    assert impl._join_work() is impl._join_work()


def test_rewritten_graphs_call_overloads_without_python_autograd():
    """What rewritten graphs call (the ``.graph`` overloads and the ``*_start`` forms) has no
    Python autograd or in-place layers around its kernels (they cost ~40 us of host per call):
    only kernels registered here, and the same results as the autograd-capable ops."""
    for name in ("all_gather_matmul.graph", "matmul_reduce_scatter.graph", "matmul_all_reduce.graph",
                 "matmul_reduce_scatter_start", "matmul_all_reduce_start"):
        table = torch._C._dispatch_dump(f"compass::{name}")
        layers = ("Autograd", "AutogradCUDA", "AutogradCPU", "ADInplaceOrView")
        python_kernels = [line for line in table.splitlines() if line.split(":")[0].removesuffix("[alias]") in layers]
        assert not python_kernels, table
    a, b = torch.randn(6, 5, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    ops = torch.ops.compass
    torch.testing.assert_close(ops.matmul_all_reduce.graph(a, b, "direct", "0", 1),
                               ops.matmul_all_reduce(a, b, "direct", "0", 1))
    torch.testing.assert_close(ops.matmul_reduce_scatter.graph(a, b, "ring", "0", 1), a @ b)
    gathered, (out,) = ops.all_gather_matmul.graph(a, [b], "double_ring", "0", 1)
    torch.testing.assert_close(gathered, a)
    torch.testing.assert_close(out, a @ b)


def test_a_capture_without_its_twin_workspace_is_a_clear_error(monkeypatch):
    """A call captured in a CUDA graph runs a twin workspace that only an eager call can build
    (allocations and a rendezvous are forbidden in a capture): without it, an error that says
    what to do, before anything is issued."""
    from compass_fx.kernels.cuda import impl

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(impl, "_capturing", lambda: True)  # what impl asks, without the Python wrapper
    with pytest.raises(RuntimeError, match="COMPASS_FUSED_GRAPHS=1 on every rank and run the same call"):
        impl._workspace(("rs", "direct", "g", 2, 8, 8), lambda fence: pytest.fail("built a plan"), "g", 8,
                        torch.empty(0, dtype=torch.bfloat16, device="meta"))
    for value, on in (("1", True), ("on", True), ("0", False), ("", False)):
        monkeypatch.setenv("COMPASS_FUSED_GRAPHS", value)
        assert impl.graphs_enabled() is on


@pytest.mark.inductor
def test_with_graphs_enabled_inductor_may_capture_the_ops():
    """``COMPASS_FUSED_GRAPHS=1`` when the ops are registered: no cudagraph_unsafe tag, so Inductor's
    CUDA graphs (mode "reduce-overhead") take them in; their warm-up run builds the twins."""
    import subprocess
    import sys

    if getattr(torch.Tag, "cudagraph_unsafe", None) is None:
        pytest.skip("this torch has no cudagraph_unsafe tag")
    code = ("import torch, compass_fx.kernels; "
            "print(torch.Tag.cudagraph_unsafe in torch.ops.compass.matmul_reduce_scatter.default.tags)")
    for value, tagged in (("1", "False"), ("0", "True")):
        env = dict(__import__("os").environ, COMPASS_FUSED_GRAPHS=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip().splitlines()[-1] == tagged, out.stderr[-2000:]


@pytest.mark.slow  # a fresh interpreter: it makes and destroys the default process group
def test_one_call_gather_follows_a_group_made_again_under_the_same_name(tmp_path):
    """``compass::all_gather_mm_parts`` names its group; once the group is destroyed, a new group
    gets the same name ("0" for the default one): the op must gather over the new group, not the
    destroyed one it met before."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import torch, torch.distributed as dist
        from compass_fx.lowering import gather_parts  # noqa: F401 - registers the op
        x, w = torch.randn(4, 3), torch.randn(3, 2)
        for attempt in range(2):
            store = dist.FileStore({str(tmp_path / "store")!r} + str(attempt), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
            name = dist.group.WORLD.group_name
            (out,) = torch.ops.compass.all_gather_mm_parts(x, [w], 2, 1, name)
            torch.testing.assert_close(out, x @ w)
            gather = gather_parts._gather_of(name, x.device)[0]  # the gather the op just ran
            assert gather.__self__ is dist.group.WORLD._get_backend(x.device), "a destroyed group's gather"
            dist.destroy_process_group()
        print("same name", name)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "same name 0" in proc.stdout
