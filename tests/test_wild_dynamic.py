"""Dynamic shapes: symbolic token dims leave the pairs untouched (with a reason), never crash or recompile.

Run on real gloo ranks: ``dynamic=True`` and ``mark_dynamic`` on the token dim, several token
counts through one compiled model, each step equal to eager forward and backward.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow  # dynamic shapes: several compiles per case

TOKENS = (8, 12, 16, 20)


def _input(name: str, rank: int, tokens: int) -> torch.Tensor:
    import tp_models
    import wild_models

    g = torch.Generator().manual_seed(tokens + 100 * rank)
    if name == "sp1_llama":
        return torch.randint(0, 64, (2, 2 * tokens), generator=torch.Generator().manual_seed(tokens))
    if name == "sp0_mlp":
        return torch.randn(tokens // 2, tp_models.DIM, generator=g)
    shape = list(wild_models.WILD[name][1])
    shape[-2] = tokens // 2
    return torch.randn(*shape, generator=g)


def _build(name: str):
    import torch.distributed as dist
    import tp_models
    import wild_models
    from torch.distributed.device_mesh import init_device_mesh

    if name in ("sp0_mlp", "sp1_llama"):
        return tp_models.build(name, init_device_mesh("cpu", (dist.get_world_size(),)))
    return wild_models.build(name, dist.group.WORLD)


def _loss(out: torch.Tensor) -> torch.Tensor:
    out = out.to_local() if hasattr(out, "to_local") else out
    return (out.float() ** 2).mean()


def dynamic_steps(rank: int, name: str, how: str) -> dict:
    import compass_fx.backend

    torch._dynamo.reset()
    eager, model = _build(name), _build(name)
    compiled = torch.compile(model, backend="compass", options={"chunks": 2, "inner": "eager"},
                             dynamic=True if how == "dynamic" else None)
    before = len(compass_fx.backend.history)
    for tokens in TOKENS:
        x = _input(name, rank, tokens)
        if how == "mark_dynamic":
            torch._dynamo.mark_dynamic(x, 1 if name == "sp1_llama" else x.dim() - 2)
        for p in list(eager.parameters()) + list(model.parameters()):
            p.grad = None
        ref, out = eager(x), compiled(x)
        _loss(ref).backward()
        _loss(out).backward()
        r, o = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (ref, out))
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5)
        for p, q in zip(model.parameters(), eager.parameters()):
            gp, gq = (g.to_local() if hasattr(g, "to_local") else g for g in (p.grad, q.grad))
            torch.testing.assert_close(gp, gq, rtol=1e-4, atol=1e-5)
    reports = list(compass_fx.backend.history)[before:]
    return {"graphs": len(reports), "rewritten": sum(p.status == "rewritten" for r in reports for p in r.pairs),
            "reasons": sorted({s.reason for r in reports for s in r.skipped})}


@pytest.mark.parametrize("name,how", [("sp0_mlp", "mark_dynamic"), ("sp1_llama", "mark_dynamic"),
                                      ("reshape_chain", "dynamic"), ("shared_uses", "dynamic")])
def test_symbolic_token_dim_is_left_alone_without_recompiles(ranks, name, how):
    results = ranks(2).run(dynamic_steps, name, how)
    res = results[0]
    assert results[1] == res
    assert res["graphs"] == 2, "one forward and one backward graph for every token count"
    assert res["rewritten"] == 0
    assert any("symbolic sizes" in r for r in res["reasons"])
