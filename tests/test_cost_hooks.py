"""Cost hooks: override, compose in order, fail loudly with the hook's name."""
import pytest

from compass_fx.cost import (CostHookError, Topology, Workload, clear_cost_hooks, register_cost_hook, select,
                             unregister_cost_hook)

TOPO = Topology.preset("h200-nvswitch-8")
W = Workload("matmul_reduce_scatter", m=8192, n=8192, k=3584, group_size=8)


@pytest.fixture(autouse=True)
def no_hooks():
    clear_cost_hooks()
    yield
    clear_cost_hooks()


def test_hook_overrides_a_prediction_and_changes_the_decision():
    seen = []

    def measured(workload, topology, candidate):
        seen.append((workload, topology, candidate.label, candidate.seconds))
        return 1e-9 if candidate.label == "decompose(d=2)" else None

    register_cost_hook(measured)
    d = select(W, TOPO)
    assert d.label == "decompose(d=2)" and d.predicted_s == 1e-9
    assert seen[0][0] is W and seen[0][1] is TOPO and seen[0][3] > 0
    assert {label for _, _, label, _ in seen} == {c.label for c in d.candidates}


def test_hooks_compose_in_registration_order():
    register_cost_hook(lambda w, t, c: c.seconds * 2)
    register_cost_hook(lambda w, t, c: c.seconds + 1.0)
    base = {c.label: c.seconds for c in select_without_hooks().candidates}
    for c in select(W, TOPO).candidates:
        assert c.seconds == pytest.approx(base[c.label] * 2 + 1.0)


def select_without_hooks():
    from compass_fx.cost.hooks import cost_hooks
    saved = cost_hooks()
    clear_cost_hooks()
    try:
        return select(W, TOPO)
    finally:
        for h in saved:
            register_cost_hook(h)


def test_none_keeps_the_model_and_unregister_removes():
    def keep(w, t, c):
        return None

    register_cost_hook(keep)
    assert select(W, TOPO) == select_without_hooks()
    unregister_cost_hook(keep)
    with pytest.raises(ValueError, match="not registered"):
        unregister_cost_hook(keep)


def test_a_raising_hook_is_reported_by_name():
    def broken_measurements(w, t, c):
        raise KeyError("no such shape")

    register_cost_hook(broken_measurements)
    with pytest.raises(CostHookError, match="broken_measurements") as err:
        select(W, TOPO)
    assert isinstance(err.value.__cause__, KeyError)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "fast", True])
def test_a_hook_returning_nonsense_is_reported(bad):
    def silly(w, t, c):
        return bad

    register_cost_hook(silly)
    with pytest.raises(CostHookError, match="silly"):
        select(W, TOPO)


def test_register_rejects_non_callables_and_works_as_decorator():
    with pytest.raises(ValueError, match="callable"):
        register_cost_hook(42)

    @register_cost_hook
    def decorated(w, t, c):
        return None

    assert callable(decorated)


def test_hook_predicting_zero_seconds_is_allowed():
    from compass_fx.cost import Topology, Workload, clear_cost_hooks, register_cost_hook, select

    clear_cost_hooks()
    register_cost_hook(lambda w, t, c: 0.0 if c.strategy == "sequential" else None)
    try:
        d = select(Workload("all_gather_matmul", m=8192, n=3584, k=4096, group_size=8),
                   Topology.preset("h200-nvswitch-8"))
    finally:
        clear_cost_hooks()
    assert d.strategy == "sequential" and "slower" in d.reason
