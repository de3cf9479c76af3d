"""torchtitan 0.3.0's Llama-3 and its tensor-parallel plan, built on CPU ranks.

Model code and TP plan are torchtitan's own (``Llama3Model.Config``, ``set_llama3_sharding_config``,
``Module.parallelize``); only the three CPU workarounds of FACTS.md are applied here: torchtitan's
Triton kernels module is stood in for when triton is absent, the device type is forced to "cpu",
and attention uses SDPA (flex attention has no CPU backward).
"""
from __future__ import annotations

import copy
import sys
import types

import torch

VOCAB = 2048


class _TritonKernelsStandIn(types.ModuleType):
    """What ``torchtitan.distributed.minimal_async_ep.kernels`` is on a machine without triton.

    torchtitan 0.3.0 imports that module (Triton kernels of its expert-parallel token dispatch)
    whenever its models are imported, and ``api.py`` imports names from it; the CPU build of
    torch brings no triton.  Any name resolves to a placeholder that raises if it is ever called,
    so a dense model that never dispatches experts imports and runs, and a model that would use
    those kernels fails loudly instead of silently."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"torchtitan's {self.__name__}.{name} is a Triton kernel, and triton is not "
                               "installed (the tests stand in for it on CPU-only machines)")

        unavailable.__name__ = name
        return unavailable


def _cpu_workarounds() -> None:
    try:
        import triton  # noqa: F401
    except ImportError:
        name = "torchtitan.distributed.minimal_async_ep.kernels"
        if name not in sys.modules:
            sys.modules[name] = _TritonKernelsStandIn(name)
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type = "cpu"
    import torchtitan.distributed.parallel_dims as tt_pd

    tt_pd.device_type = "cpu"


def build_llama3(world: int, sequence_parallel: bool, layers: int = 2, seed: int = 0,
                 checkpoint: bool = False, dims=None) -> torch.nn.Module:
    """torchtitan's llama3 "debugmodel" (dim 256, 16 heads) with ``layers`` layers, TP over ``world``.

    Every rank must call this (it builds the device mesh); the same seed gives the same weights.
    """
    _cpu_workarounds()
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.common import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    config = llama3_configs["debugmodel"](attn_backend="flex")
    # the debug model has 6 layers: deeper models repeat them (each layer its own config)
    config.layers = [copy.deepcopy(config.layers[i % len(config.layers)]) for i in range(layers)]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_llama3_sharding_config(config, enable_sp=sequence_parallel)
    torch.manual_seed(seed)
    model = config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # full weights, identical on every rank
    if dims is None:  # pass another model's ``compass_dims`` to reuse its meshes (no new groups)
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world, pp=1, ep=1, world_size=world)
        dims.build_mesh()
    model.parallelize(dims)  # each rank keeps its shard
    if checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )

        for name, block in list(model.layers.named_children()):
            model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))
    model.train()
    model.compass_dims = dims  # what ``spmd_context`` needs
    return model


def spmd_context(model: torch.nn.Module, inputs: torch.Tensor):
    """torchtitan's SPMD context for one step (what its trainer enters), with ``inputs`` annotated.

    Without it the spmd_types backend issues no collectives at all.
    """
    import contextlib

    import spmd_types as spmd
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.parallel_dims import MeshAxisName
    from torchtitan.distributed.spmd_types import set_current_spmd_mesh

    dims = model.compass_dims
    dist_utils.set_spmd_backend("spmd_types")
    stack = contextlib.ExitStack()
    stack.enter_context(dist_utils.get_spmd_context(parallel_dims=dims)())
    with set_current_spmd_mesh(dims.spmd_dense_mesh()):
        spmd.assert_type(inputs, {MeshAxisName.DP: spmd.S(0), MeshAxisName.CP: spmd.S(1),
                                  MeshAxisName.TP: spmd.R})
    return stack


def tokens(batch: int = 2, seq: int = 16, seed: int = 7) -> torch.Tensor:
    """The same token batch on every rank (TP ranks see the same data)."""
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def linear_count(model: torch.nn.Module) -> dict[str, int]:
    """Hand count helper: the model's linears by leaf name (wqkv, wo, w1, w2, w3, lm_head ...)."""
    counts: dict[str, int] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            leaf = name.rsplit(".", 1)[-1]
            counts[leaf] = counts.get(leaf, 0) + 1
    return counts
