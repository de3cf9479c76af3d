"""The explain report as text: the table a first-time reader sees."""
from compass_fx.report import GraphReport, PairRecord, Report, format_report


def pair(d_star: float | None) -> PairRecord:
    return PairRecord(graph="forward", collective="all_gather_into_tensor", kind="all_gather_matmul", dim=1,
                      shape=[2, 8, 64], m=32, n=64, k=64, matmuls=1, group="0", group_size=2, dtype="float32",
                      strategy="sequential", parts=1, status="kept", reason="cost model: sequential is fastest",
                      candidates=[{"label": "sequential", "seconds": 1e-5},
                                  {"label": "decompose(d=2)", "seconds": 2e-5}],
                      topology="h200-nvswitch-8", d_star=d_star)


def test_legend_explains_group_and_d_star():
    text = format_report(Report(graphs=[GraphReport("forward", pairs=[pair(0.04)])]))
    table, legend = text.split("\nlegend: ")
    assert "0/2" in table and "(d*=0.04)" in table
    assert legend.startswith("group = the collective's process group as name/ranks (0/2: group '0' of 2 ranks)")
    assert "d* = the decomposition model's continuous optimum sqrt(C/A)" in legend
    assert "before rounding to a feasible part count" in legend


def test_legend_only_explains_what_is_shown():
    text = format_report(Report(graphs=[GraphReport("forward", pairs=[pair(None)])]))
    assert "legend: group = " in text and "d*" not in text
    assert "legend" not in format_report(Report(graphs=[GraphReport("forward")]))
