"""The fused operators as torch.library custom ops in namespace ``compass``.

Registered once when ``compass_fx.kernels`` is imported.  Each op has a fake (meta) kernel so it
survives tracing as one node, an any-backend kernel (the schedule over point-to-point messages,
:mod:`.reference`), a CUDA kernel (peer-to-peer copies out of symmetric memory on the copy engines,
epoch flags, cuBLAS per piece: :mod:`.cuda.impl` running :mod:`.protocol`'s plans), and autograd
whose backward is expressed through the other ops, so eager training works too.

Layout: every matrix is 2-D and rows are rank-major blocks, exactly as
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` on dim 0 lay them out.
"""
from __future__ import annotations

import os
from typing import Sequence

import torch
from torch import Tensor

from . import reference
from .cuda import graphs_enabled
from .cuda.lane import OPS as _LANE_OPS
from .cuda.lane import fast_calls as _fast_calls  # what the CUDA kernels try first (replays issued from C)
from .cuda.lane import enter_from_c
from .schedules import SCHEDULES, check_schedule_name

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# A call captured in a CUDA graph runs a twin workspace (the epoch in GPU memory) that an eager call
# builds first, and only with COMPASS_FUSED_GRAPHS=1 (cuda/impl.py).  Without it, Inductor's CUDA
# graphs must keep these ops out; with it they may take them in (their warm-up run is that eager
# call).  Read once, when the ops are registered.
_TAGS = () if graphs_enabled() else tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


def fused_ops_capturable() -> bool:
    """Whether Inductor's CUDA graphs may take the fused operators in (``COMPASS_FUSED_GRAPHS=1``
    when they were registered); otherwise each one splits the graphs around it."""
    return not _TAGS


# The CUDA kernels are registered with the dispatcher directly rather than through the custom op's
# ``register_kernel``, whose wrapper (an output-aliasing check, a dynamo guard, a table lookup)
# cost 3-55 us of host time per call, median 25 (H200 machine, 2 ranks, gathers of 256-4096 rows,
# the two forms timed in turns: benchmarks/results/fused_host_time/fused_host_time-h200-interleaved-*.json).  A
# small fused call's device time is of that order.
_CUDA_KERNELS = torch.library.Library("compass", "IMPL")


def _cuda_kernel(name: str):
    """Register the decorated function as ``compass::<name>``'s CUDA kernel."""
    def register(fn):
        _CUDA_KERNELS.impl(name, fn, "CUDA")
        return fn
    return register


_impl = []
_AG, _RS, _AR = (_LANE_OPS[name] for name in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"))


def _cuda():
    """``.cuda.impl``, imported on first use (the CPU-only paths never load the driver bindings) and
    then kept: an import statement per call costs the host ~1 us."""
    if not _impl:
        from .cuda import impl

        _impl.append(impl)
    return _impl[0]


def _check_common(a: Tensor, bs: Sequence[Tensor], schedule: str, group_size: int) -> None:
    check_schedule_name(schedule)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got group_size={group_size}")
    if a.dim() != 2:
        raise ValueError(f"expected a 2-D left operand, got shape {tuple(a.shape)}")
    for b in bs:
        if b.dim() != 2 or b.shape[0] != a.shape[1]:
            raise ValueError(f"cannot multiply {tuple(a.shape)} by {tuple(b.shape)}")
        if b.dtype != a.dtype or b.device != a.device:
            raise ValueError(f"operands differ in dtype/device: {a.dtype}/{a.device} vs {b.dtype}/{b.device}")


_SCHEDULE_NAMES = frozenset(SCHEDULES)


def _check_cuda(a: Tensor, bs: Sequence[Tensor], schedule: str, group_size: int) -> None:
    """:func:`_check_common` for a CUDA kernel's call, which passes it in the common case with no
    Python frame per check and no device object (``get_device`` is an int); any doubt: the full
    check, which raises the error."""
    if schedule in _SCHEDULE_NAMES and group_size >= 1 and a.dim() == 2:
        k, dtype, device = a.shape[1], a.dtype, a.get_device()
        for b in bs:
            if b.dim() != 2 or b.shape[0] != k or b.dtype != dtype or b.get_device() != device:
                break
        else:
            return
    _check_common(a, bs, schedule, group_size)


def _check_divisible(rows: int, group_size: int) -> None:
    if rows % group_size:
        raise ValueError(f"reduce-scatter needs rows divisible by group_size: {rows} % {group_size} != 0")


# --------------------------------------------------------------------------------------------
# compass::all_gather_matmul
# --------------------------------------------------------------------------------------------
_AG_SCHEMA = "(Tensor a_shard, Tensor[] bs, str schedule, str group_name, int group_size) -> (Tensor, Tensor[])"


def _ag_any(a_shard: Tensor, bs: list[Tensor], schedule: str, group_name: str,
            group_size: int) -> tuple[Tensor, list[Tensor]]:
    """gathered = all_gather(a_shard, dim 0); outs[j] = gathered @ bs[j] (one gather, many weights)."""
    _check_common(a_shard, bs, schedule, group_size)
    return reference.all_gather_matmul(a_shard.contiguous(), bs, schedule, group_name, group_size)


all_gather_matmul = torch.library.custom_op("compass::all_gather_matmul", _ag_any, mutates_args=(), tags=_TAGS,
                                            schema=_AG_SCHEMA)


@all_gather_matmul.register_fake
def _ag_fake(a_shard: Tensor, bs: list[Tensor], schedule: str, group_name: str, group_size: int):
    _check_common(a_shard, bs, schedule, group_size)
    rows = a_shard.shape[0] * group_size
    return a_shard.new_empty((rows, a_shard.shape[1])), [a_shard.new_empty((rows, b.shape[1])) for b in bs]


@_cuda_kernel("all_gather_matmul")
def _ag_cuda(a_shard: Tensor, bs: list[Tensor], schedule: str, group_name: str, group_size: int):
    if _fast_calls:  # a replayed call whose graph exists, issued from C (.cuda.lane)
        out = _fast_calls[0](_AG, a_shard, bs, schedule, group_name, group_size)
        if out is not None:
            return out
    return _ag_python(a_shard, bs, schedule, group_name, group_size)


def _ag_python(a_shard: Tensor, bs: list[Tensor], schedule: str, group_name: str, group_size: int):
    """The CUDA kernel's Python path (a call C declined)."""
    _check_cuda(a_shard, bs, schedule, group_size)
    cuda = _cuda()
    if cuda.supported(a_shard.dtype):
        return cuda.all_gather_matmul(a_shard.contiguous(), bs, schedule, group_name, group_size)
    return reference.all_gather_matmul(a_shard.contiguous(), bs, schedule, group_name, group_size)


def _ag_setup(ctx, inputs, output) -> None:
    _, bs, schedule, group_name, group_size = inputs
    gathered, _ = output
    ctx.args = (schedule, group_name, group_size)
    ctx.n_bs = len(bs)
    ctx.save_for_backward(gathered, *bs)


def _ag_backward(ctx, grad_gathered, grad_outs):
    """d a_shard = reduce_scatter(sum_j d out_j @ b_j^T + d gathered); d b_j = gathered^T @ d out_j."""
    schedule, group_name, group_size = ctx.args
    gathered, *bs = ctx.saved_tensors
    grad_outs = list(grad_outs) if grad_outs is not None else [None] * len(bs)
    live = [(g, b) for g, b in zip(grad_outs, bs) if g is not None]
    grad_a = None
    if live:
        g_cat = torch.cat([g for g, _ in live], dim=1) if len(live) > 1 else live[0][0]
        b_cat = torch.cat([b.t() for _, b in live], dim=0) if len(live) > 1 else live[0][1].t()
        grad_a = matmul_reduce_scatter(g_cat.contiguous(), b_cat, schedule, group_name, group_size)
    if grad_gathered is not None:
        if group_size == 1:
            rs = grad_gathered
        else:
            rs = torch.ops._c10d_functional.reduce_scatter_tensor(grad_gathered.contiguous(), "sum",
                                                                  group_size, group_name)
            rs = torch.ops._c10d_functional.wait_tensor(rs)
        grad_a = rs if grad_a is None else grad_a + rs
    grad_bs = [None if g is None else gathered.t() @ g for g in grad_outs]
    return grad_a, grad_bs, None, None, None


all_gather_matmul.register_autograd(_ag_backward, setup_context=_ag_setup)


# --------------------------------------------------------------------------------------------
# compass::matmul_reduce_scatter
# --------------------------------------------------------------------------------------------
_MATMUL_SCHEMA = "(Tensor a, Tensor b, str schedule, str group_name, int group_size) -> Tensor"


def _rs_any(a: Tensor, b: Tensor, schedule: str, group_name: str, group_size: int) -> Tensor:
    """reduce_scatter(a @ b, "sum") on dim 0, pieces produced in the order the ring sends them."""
    _check_common(a, [b], schedule, group_size)
    _check_divisible(a.shape[0], group_size)
    return reference.matmul_reduce_scatter(a, b, schedule, group_name, group_size)


matmul_reduce_scatter = torch.library.custom_op("compass::matmul_reduce_scatter", _rs_any, mutates_args=(),
                                                tags=_TAGS, schema=_MATMUL_SCHEMA)


@matmul_reduce_scatter.register_fake
def _rs_fake(a: Tensor, b: Tensor, schedule: str, group_name: str, group_size: int):
    _check_common(a, [b], schedule, group_size)
    _check_divisible(a.shape[0], group_size)
    return a.new_empty((a.shape[0] // group_size, b.shape[1]))


@_cuda_kernel("matmul_reduce_scatter")
def _rs_cuda(a: Tensor, b: Tensor, schedule: str, group_name: str, group_size: int):
    if _fast_calls:  # a replayed call whose graph exists, issued from C (.cuda.lane)
        out = _fast_calls[0](_RS, a, b, schedule, group_name, group_size)
        if out is not None:
            return out
    return _rs_python(a, b, schedule, group_name, group_size)


def _rs_python(a: Tensor, b: Tensor, schedule: str, group_name: str, group_size: int):
    """The CUDA kernel's Python path (a call C declined)."""
    _check_cuda(a, (b,), schedule, group_size)
    _check_divisible(a.shape[0], group_size)
    cuda = _cuda()
    if cuda.supported(a.dtype):
        return cuda.matmul_reduce_scatter(a, b, schedule, group_name, group_size)
    return reference.matmul_reduce_scatter(a, b, schedule, group_name, group_size)


def _rs_setup(ctx, inputs, output) -> None:
    a, b, schedule, group_name, group_size = inputs
    ctx.args = (schedule, group_name, group_size)
    ctx.save_for_backward(a, b)


def _rs_backward(ctx, grad):
    """The adjoint of reduce-scatter is all-gather: d a = all_gather(d out) @ b^T, d b = a^T @ it."""
    schedule, group_name, group_size = ctx.args
    a, b = ctx.saved_tensors
    gathered, (grad_a,) = all_gather_matmul(grad.contiguous(), [b.t()], schedule, group_name, group_size)
    return grad_a, a.t() @ gathered, None, None, None


matmul_reduce_scatter.register_autograd(_rs_backward, setup_context=_rs_setup)


# --------------------------------------------------------------------------------------------
# compass::matmul_all_reduce
# --------------------------------------------------------------------------------------------
def _ar_any(a: Tensor, b: Tensor, schedule: str, group_name: str, group_size: int) -> Tensor:
    """all_reduce(a @ b, "sum"): reduce-scatter then all-gather on the same rings."""
    _check_common(a, [b], schedule, group_size)
    return reference.matmul_all_reduce(a, b, schedule, group_name, group_size)


matmul_all_reduce = torch.library.custom_op("compass::matmul_all_reduce", _ar_any, mutates_args=(), tags=_TAGS,
                                            schema=_MATMUL_SCHEMA)


@matmul_all_reduce.register_fake
def _ar_fake(a: Tensor, b: Tensor, schedule: str, group_name: str, group_size: int):
    _check_common(a, [b], schedule, group_size)
    return a.new_empty((a.shape[0], b.shape[1]))


@_cuda_kernel("matmul_all_reduce")
def _ar_cuda(a: Tensor, b: Tensor, schedule: str, group_name: str, group_size: int):
    if _fast_calls:  # a replayed call whose graph exists, issued from C (.cuda.lane)
        out = _fast_calls[0](_AR, a, b, schedule, group_name, group_size)
        if out is not None:
            return out
    return _ar_python(a, b, schedule, group_name, group_size)


def _ar_python(a: Tensor, b: Tensor, schedule: str, group_name: str, group_size: int):
    """The CUDA kernel's Python path (a call C declined)."""
    _check_cuda(a, (b,), schedule, group_size)
    cuda = _cuda()
    if cuda.supported(a.dtype) and a.shape[0] % group_size == 0:
        return cuda.matmul_all_reduce(a, b, schedule, group_name, group_size)
    return reference.matmul_all_reduce(a, b, schedule, group_name, group_size)


def _ar_setup(ctx, inputs, output) -> None:
    a, b, *_ = inputs
    ctx.save_for_backward(a, b)


def _ar_backward(ctx, grad):
    """Row-parallel convention (Megatron's, and DTensor's Partial->Replicate): the output and its
    gradient are replicated, so the collective's backward is the identity and only the local
    matmuls remain.  (The literal adjoint, an all-reduce of the gradient, would count a loss
    that every rank computes identically ``group_size`` times.)"""
    a, b = ctx.saved_tensors
    return grad @ b.t(), a.t() @ grad, None, None, None


matmul_all_reduce.register_autograd(_ar_backward, setup_context=_ar_setup)


# --------------------------------------------------------------------------------------------
# What rewritten graphs call: the ``.graph`` overloads, and the asynchronous ``*_start`` forms
# --------------------------------------------------------------------------------------------
# A rewritten graph runs after AOTAutograd, so nothing in it needs the ops' autograd; the custom
# op's Python layers around every call (autograd, the aliasing checks, a dynamo guard) cost ~40 us
# of host time per call on the CPU machine against ~3 us for an op defined on the dispatcher
# directly.  So the graphs call the same kernels through overloads defined here, with no autograd:
# on the H200 machine 27-41 us less host time per fused call, median over 10 shapes
# (benchmarks/results/fused_host_time/fused_host_time-h200-graph-overloads{,-run2}.json).
_GRAPH_OPS = torch.library.Library("compass", "FRAGMENT")


def _graph_op(qualname: str, schema: str, any_backend, fake, cuda_kernel) -> None:
    """Define ``compass::<qualname>`` (name or name.overload) with these kernels and no autograd."""
    _GRAPH_OPS.define(qualname + schema, tags=_TAGS)
    _GRAPH_OPS.impl(qualname, any_backend, "CompositeExplicitAutograd")
    _GRAPH_OPS.impl(qualname, cuda_kernel, "CUDA")
    torch.library.register_fake(f"compass::{qualname}", fake, lib=_GRAPH_OPS)


_graph_op("all_gather_matmul.graph", _AG_SCHEMA, _ag_any, _ag_fake, _ag_cuda)
_graph_op("matmul_reduce_scatter.graph", _MATMUL_SCHEMA, _rs_any, _rs_fake, _rs_cuda)
_graph_op("matmul_all_reduce.graph", _MATMUL_SCHEMA, _ar_any, _ar_fake, _ar_cuda)


# The ``.graph`` overloads' eager CUDA calls skip the C++ dispatcher: for plain CUDA tensors outside
# any mode or transform, the dispatcher can only pick the CUDA kernel registered above (these
# overloads have no autograd, autocast or other kernel), yet its boxing of the arguments into the
# Python kernel and back cost ~30 us of a ~110 us replayed call on the lent H200 host
# (fused_host_time-h200-replay-trim: .graph against impl).  Anything else (a tensor subclass such as
# a fake or functional tensor, a dispatch or torch-function mode, a functorch transform, a CPU
# tensor, an input that requires grad while grad mode is on) takes the dispatcher as before.  A gather
# is plain with every weight of its list plain: Q, K and V share one gathered input in a sequence-
# parallel attention, w1 and w3 in its MLP, so most gathers of a real model carry two or three (they
# took the dispatcher while only one weight counted as plain).  Once the host fast path is built, C
# takes these calls from OpOverload.__call__ on (.cuda.lane.enter_from_c).
_plain = torch.Tensor
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
_function_modes = getattr(torch._C, "_is_torch_function_mode_enabled", None)
_transforms = getattr(torch._C, "_are_functorch_transforms_active", None)
_grad_on = torch.is_grad_enabled


def _plain_cuda(a: Tensor, b: Tensor) -> bool:
    return (type(a) is _plain and type(b) is _plain and a.is_cuda and not _dispatch_modes()
            and not _function_modes() and not _transforms()
            and not ((a.requires_grad or b.requires_grad) and _grad_on()))


def _plain_cuda_list(a: Tensor, bs: list) -> bool:
    """:func:`_plain_cuda` for a left operand and a list of weights."""
    return (type(a) is _plain and all(type(b) is _plain for b in bs) and a.is_cuda and not _dispatch_modes()
            and not _function_modes() and not _transforms()
            and not ((a.requires_grad or any(b.requires_grad for b in bs)) and _grad_on()))


def _direct_possible() -> bool:
    """Whether this torch lets :func:`_direct` tell a plain call apart (and it is not turned off by
    ``COMPASS_FUSED_DIRECT=0``)."""
    return None not in (_dispatch_modes, _function_modes, _transforms) and os.environ.get("COMPASS_FUSED_DIRECT",
                                                                                          "1") != "0"


def _skip_dispatcher(overload, kernel, weights_listed: bool) -> None:
    """Let ``overload``'s calls on plain CUDA tensors run ``kernel`` directly (see above); any other
    call takes the dispatcher as before."""
    through_dispatcher = overload._op

    if weights_listed:
        def call(a_shard, bs, schedule, group_name, group_size):
            if type(bs) is list and bs and _plain_cuda_list(a_shard, bs):
                return kernel(a_shard, bs, schedule, group_name, group_size)
            return through_dispatcher(a_shard, bs, schedule, group_name, group_size)
    else:
        def call(a, b, schedule, group_name, group_size):
            if _plain_cuda(a, b):
                return kernel(a, b, schedule, group_name, group_size)
            return through_dispatcher(a, b, schedule, group_name, group_size)
    call.through_dispatcher = through_dispatcher
    overload._op = call  # what OpOverload.__call__ runs


def _direct(overload, kernel, weights_listed: bool, python_path) -> None:
    """:func:`_skip_dispatcher`, and C takes the calls once the host fast path is built
    (:func:`.cuda.lane.enter_from_c`: a call it declines runs ``python_path``, the kernel without
    its try of C)."""
    _skip_dispatcher(overload, kernel, weights_listed)
    enter_from_c(overload, overload._overloadpacket.__name__, python_path, weights_listed,
                 (_dispatch_modes, _function_modes, _transforms))


if _direct_possible():
    _direct(torch.ops.compass.all_gather_matmul.graph, _ag_cuda, True, _ag_python)
    _direct(torch.ops.compass.matmul_reduce_scatter.graph, _rs_cuda, False, _rs_python)
    _direct(torch.ops.compass.matmul_all_reduce.graph, _ar_cuda, False, _ar_python)


def _start_op(name: str, sync_op, cuda_fn, out_rows) -> None:
    """The asynchronous form of a reducing fused operator, for rewritten graphs (no autograd):
    it returns once the GEMMs are issued, and ``_c10d_functional.wait_tensor`` on its result (as
    for a functional collective) makes the caller's stream wait for the rest; meanwhile the
    caller's stream is free for work that does not need the result.  Without a CUDA plan
    (CPU, or a dtype the CUDA path lacks) it runs synchronously and the wait is a no-op."""

    def start(a: Tensor, b: Tensor, schedule: str, group_name: str, group_size: int) -> Tensor:
        return sync_op(a, b, schedule, group_name, group_size)

    def fake(a: Tensor, b: Tensor, schedule: str, group_name: str, group_size: int):
        _check_common(a, [b], schedule, group_size)
        _check_divisible(a.shape[0], group_size)
        return a.new_empty((out_rows(a.shape[0], group_size), b.shape[1]))

    def cuda_kernel(a: Tensor, b: Tensor, schedule: str, group_name: str, group_size: int):
        _check_cuda(a, (b,), schedule, group_size)
        _check_divisible(a.shape[0], group_size)
        cuda = _cuda()
        if cuda.supported(a.dtype):
            return getattr(cuda, cuda_fn)(a, b, schedule, group_name, group_size, deferred=True)
        return sync_op(a, b, schedule, group_name, group_size)

    _graph_op(name, _MATMUL_SCHEMA, start, fake, cuda_kernel)
    if _direct_possible():  # plain CUDA tensors skip the dispatcher, as the .graph overloads' calls do
        _skip_dispatcher(getattr(torch.ops.compass, name).default, cuda_kernel, False)


_start_op("matmul_reduce_scatter_start", _rs_any, "matmul_reduce_scatter", lambda rows, g: rows // g)
_start_op("matmul_all_reduce_start", _ar_any, "matmul_all_reduce", lambda rows, g: rows)


# --------------------------------------------------------------------------------------------
def fused_schedules_available(device_type: str, dtype: torch.dtype) -> tuple[str, ...]:
    """Schedules with a real fused implementation for ``device_type``/``dtype``.

    CPU: the point-to-point implementation, for floating dtypes.  CUDA: the copy-engine
    implementation for bf16 / fp16 / fp32 (or the point-to-point one over NCCL when
    ``COMPASS_CUDA_FUSED=p2p``).
    Anything else: none (the cost model then offers no fusion)."""
    if device_type == "cpu":
        return SCHEDULES if dtype in _FLOAT_DTYPES else ()
    if device_type == "cuda":
        from .cuda import impl as cuda

        if cuda.supported(dtype):
            return SCHEDULES
        return SCHEDULES if os.environ.get("COMPASS_CUDA_FUSED") == "p2p" and dtype in _FLOAT_DTYPES else ()
    return ()
