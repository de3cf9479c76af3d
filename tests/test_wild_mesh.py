"""2-D meshes (data parallel x tensor parallel) on 4 gloo ranks: only TP collectives are touched.

FSDP2 ``fully_shard`` on the outer dim gathers and reduce-scatters parameters in its hooks,
outside the compiled graphs; a data-parallel all-reduce written inside the model is in the graph
and must be left alone when the TP group is the one optimised.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow  # FSDP2 + TP meshes on 4 ranks

WORLD = 4


def _sp_mlp(tp_mesh):
    import tp_models
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    return parallelize_module(tp_models.MLP(bias=False), tp_mesh, {
        "norm": SequenceParallel(sequence_dim=0),
        "w1": ColwiseParallel(input_layouts=Shard(0)),
        "w2": RowwiseParallel(output_layouts=Shard(0)),
    })


class DataParallelTail(torch.nn.Module):
    """A sequence-parallel MLP whose output is then summed over the data-parallel group in-graph."""

    def __init__(self, mesh) -> None:
        super().__init__()
        self.mlp, self.dp_group = _sp_mlp(mesh["tp"]), mesh["dp"].get_group()

    def forward(self, x):
        import torch.distributed._functional_collectives as fc

        y = self.mlp(x)
        y = y.to_local() if hasattr(y, "to_local") else y
        return fc.all_reduce(y @ torch.ones(y.shape[-1], y.shape[-1]), "sum", self.dp_group)


_MESH = []


def _mesh():
    """One 2-D mesh per process: DTensor caches groups by mesh layout, so a second identical mesh
    would trace collectives on the first mesh's groups while ``mesh["tp"]`` names the new ones."""
    from torch.distributed.device_mesh import init_device_mesh

    if not _MESH:
        _MESH.append(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    return _MESH[0]


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def mesh_step(rank: int, variant: str) -> dict:
    import torch.distributed as dist
    import tp_models
    from torch.distributed.fsdp import fully_shard

    import compass_fx.backend

    torch._dynamo.reset()
    mesh = _mesh()
    tp_name, dp_name = mesh["tp"].get_group().group_name, mesh["dp"].get_group().group_name
    models = []
    for _ in range(2):
        m = _sp_mlp(mesh["tp"]) if variant == "fsdp" else DataParallelTail(mesh)
        if variant == "fsdp":
            fully_shard(m, mesh=mesh["dp"])
        models.append(m)
    eager, model = models
    g = torch.Generator().manual_seed(10 + mesh["dp"].get_local_rank())  # DP ranks see different data
    full = torch.randn(16, tp_models.DIM, generator=g)
    x = full.chunk(2)[mesh["tp"].get_local_rank()].contiguous()
    options = {"chunks": 2, "inner": "eager"} | ({"group": mesh["tp"]} if variant == "dp_in_graph" else {})
    before = len(compass_fx.backend.history)
    out = torch.compile(model, backend="compass", options=options)(x)
    ref = eager(x)
    (_local(ref).float() ** 2).mean().backward()
    (_local(out).float() ** 2).mean().backward()
    torch.testing.assert_close(_local(out), _local(ref), rtol=1e-4, atol=1e-5)
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(_local(p.grad), _local(q.grad), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=n: f"{n}: {m}")
    dist.barrier()
    reports = list(compass_fx.backend.history)[before:]
    return {"pairs": sorted((p.graph, p.kind, "tp" if p.group == tp_name else "dp", p.status)
                            for r in reports for p in r.pairs),
            "skipped": sorted((s.graph, s.reason) for r in reports for s in r.skipped
                              if f"group {dp_name!r}" in s.reason)}


def test_fsdp2_outer_dim_tp_inner_dim(ranks):
    res = ranks(WORLD).run(mesh_step, "fsdp")
    assert all(r["pairs"] == res[0]["pairs"] for r in res)
    assert res[0]["pairs"] == [("backward", "all_gather_matmul", "tp", "rewritten"),
                               ("backward", "matmul_reduce_scatter", "tp", "rewritten"),
                               ("forward", "all_gather_matmul", "tp", "rewritten"),
                               ("forward", "matmul_reduce_scatter", "tp", "rewritten")]


def test_data_parallel_collective_in_graph_is_left_alone(ranks):
    res = ranks(WORLD).run(mesh_step, "dp_in_graph")
    pairs = res[0]["pairs"]
    assert pairs and all(group == "tp" and status == "rewritten" for _, _, group, status in pairs)
    assert any("not the optimised group" in why for _, why in res[0]["skipped"]), res[0]["skipped"]
