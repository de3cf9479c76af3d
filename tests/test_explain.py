"""explain tells the truth about a compiled model, and last_report shows only what models compiled."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import compass_fx
import tp_models

WORLD = 2


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield init_device_mesh("cpu", (WORLD,))
    dist.destroy_process_group()


def _mlp(mesh):
    torch._dynamo.reset()
    return tp_models.build("sp0_mlp", mesh), tp_models.example_input("sp0_mlp", 0, WORLD).requires_grad_()


def test_a_model_compiled_with_options_is_explained_with_them(mesh):
    model, x = _mlp(mesh)
    compiled = torch.compile(model, backend="compass", options={"chunks": 4, "inner": "eager"})
    report = compass_fx.explain(compiled, x)
    assert report.options["chunks"] == 4 and report.options["strategy"] != "off"
    assert report.pairs and all(p.status == "rewritten" and p.parts == 4 for p in report.pairs)
    # the same options given again agree; other options would explain another compile: refused
    assert compass_fx.explain(compiled, x, chunks=4, inner="eager").options["chunks"] == 4
    with pytest.raises(ValueError) as e:
        compass_fx.explain(compiled, x, strategy="off")
    assert "compiled with backend='compass' and options {'chunks': 4, 'inner': 'eager'}" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_model_compiled_with_a_mode_is_explained_under_it(mesh):
    model, x = _mlp(mesh)
    compiled = torch.compile(model, backend="compass", mode="reduce-overhead")
    report = compass_fx.explain(compiled, x)
    assert report.options["mode"] == "reduce-overhead"
    assert any("replays CUDA graphs" in n for g in report.graphs for n in g.notes)


def test_a_model_compiled_with_another_backend_is_explained_with_the_options_given(mesh):
    model, x = _mlp(mesh)
    report = compass_fx.explain(torch.compile(model, backend="eager"), x, chunks=2)
    assert report.pairs and all(p.parts == 2 for p in report.pairs)


def test_last_report_shows_the_latest_compile_only(mesh):
    """explain's traces are not the model's: after explain and a forward-only call of a compiled
    model, last_report holds that model's forward graph alone; after a backward, its backward too."""
    model, x = _mlp(mesh)
    compass_fx.explain(model, x, chunks=2)
    compiled = torch.compile(model, backend="compass", options={"chunks": 2, "inner": "eager"})
    out = compiled(x)
    assert [g.graph for g in compass_fx.last_report().graphs] == ["forward"]
    out.sum().backward()
    assert [g.graph for g in compass_fx.last_report().graphs] == ["forward", "backward"]
    assert len(compass_fx.last_report(graphs=1).graphs) == 1


def test_explain_as_often_as_wanted_and_the_models_compile_keeps_its_limit(mesh):
    """Each explain is a new compile of the model's code for Dynamo (a backend of its own): sharing
    the model's cache entries, the ninth explain in a process hit Dynamo's recompile limit and
    reported nothing, and each counted against the limit of the model's own torch.compile.  With
    the limit lowered to 2: four explains all report every pair, and the model then compiles with
    compass as usual."""
    import importlib

    if not importlib.import_module("compass_fx.explain")._OWN_RECOMPILES:
        pytest.skip("this torch's torch.compile has no isolate_recompiles")
    model, x = _mlp(mesh)
    with torch._dynamo.config.patch(recompile_limit=2):
        counts = [len(compass_fx.explain(model, x, chunks=2).pairs) for _ in range(4)]
        assert counts[0] > 0 and counts == counts[:1] * 4, counts
        compiled = torch.compile(model, backend="compass", options={"chunks": 2, "inner": "eager"})
        compiled(x).sum().backward()
    assert len(compass_fx.last_report().pairs) == counts[0]


def test_a_model_dynamo_hands_no_graph_is_an_error_not_an_empty_report(mesh):
    class Skipped(torch.nn.Module):
        @torch.compiler.disable
        def forward(self, x):
            return x @ x.t()

    with pytest.raises(RuntimeError, match="Dynamo handed the backend no graph of this model"):
        compass_fx.explain(Skipped(), torch.randn(4, 4))


def test_an_explain_of_another_shape_leaves_the_models_compile_static(mesh):
    """Dynamo makes a size dynamic once a compile of the same code sees another (automatic dynamic
    shapes), and the pass leaves pairs of symbolic size alone: an explain with an example of twice
    the rows made the model's own compile that came after it dynamic, which then rewrote nothing.
    Now explain leaves the sizes Dynamo noted as they were, and traces its example as given even
    after the model ran at another shape."""
    model, x = _mlp(mesh)
    twice = torch.cat([x, x]).detach().requires_grad_()
    explained = compass_fx.explain(model, twice, chunks=2)
    assert explained.pairs and all(p.status == "rewritten" for p in explained.pairs)
    compiled = torch.compile(model, backend="compass", options={"chunks": 2, "inner": "eager"})
    compiled(x).sum().backward()
    own = compass_fx.last_report()
    assert len(own.pairs) == len(explained.pairs) and all(p.status == "rewritten" for p in own.pairs), own.skipped
    again = compass_fx.explain(model, torch.cat([x, x, x]).detach().requires_grad_(), chunks=2)
    assert len(again.pairs) == len(explained.pairs) and all(p.status == "rewritten" for p in again.pairs)


def test_a_second_token_count_is_rewritten_only_where_compiled_with_dynamic_false(mesh):
    """What the README says of dynamic shapes: by default Dynamo compiles a model again, with
    symbolic sizes, when it runs at a second token count, and the pass leaves pairs of symbolic
    size alone, saying so; compiled with ``dynamic=False`` each count gets a static compile of its
    own, every pair rewritten."""
    for dynamic in (None, False):
        model, x = _mlp(mesh)
        compiled = torch.compile(model, backend="compass", options={"chunks": 2, "inner": "eager"}, dynamic=dynamic)
        compiled(x)
        compiled(torch.cat([x, x]).detach())
        second = compass_fx.last_report()
        if dynamic is None:
            assert not second.pairs and second.skipped, second.pairs
            assert all("symbolic sizes (dynamic shapes)" in s.reason for s in second.skipped), second.skipped
        else:
            assert second.pairs and all(p.status == "rewritten" for p in second.pairs), second.skipped
