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


def test_pairs_alike_share_a_row_with_their_count():
    """A model's repeated layers give pairs alike in everything the table shows: one row each, with
    how many, so the table grows with the distinct pairs, not the depth; the candidates, the
    refusals and the collectives left alone likewise; ``every_pair`` gives a row per pair."""
    from dataclasses import replace

    from compass_fx.report import SkipRecord

    refused = [{"strategy": "fuse", "reason": "the pair has wild-graph details (dtype casts)"}]
    layers = [replace(pair(0.04), collective=f"all_gather_into_tensor_{i}", refused=refused) for i in range(3)]
    other = replace(pair(0.04), collective="all_gather_into_tensor_9", m=64)  # another shape: its own row
    skips = [SkipRecord("forward", f"all_gather_into_tensor_{i}", "all_gather_matmul", "feeds no matmul")
             for i in (10, 11)]
    report = Report(graphs=[GraphReport("forward", pairs=[*layers, other], skipped=skips)])

    text = format_report(report)
    rows = [line.split() for line in text.splitlines() if line.startswith("forward ")]
    assert [(r[1], r[2], r[5]) for r in rows] == [("3", "all_gather_into_tensor_0", "32x64x64"),
                                                  ("1", "all_gather_into_tensor_9", "64x64x64")], text
    assert text.startswith("4 pairs in 2 rows")
    assert "candidates forward/all_gather_into_tensor_0 (+2 like it) (d*=0.04)" in text
    assert "refused forward/all_gather_into_tensor_0 (+2 like it): fuse: the pair has wild-graph details" in text
    assert "left alone: forward all_gather_matmul all_gather_into_tensor_10 (+1 like it): feeds no matmul" in text

    every = report.format(every_pair=True)
    assert [line.split()[2] for line in every.splitlines() if line.startswith("forward ")] == [
        "all_gather_into_tensor_0", "all_gather_into_tensor_1", "all_gather_into_tensor_2", "all_gather_into_tensor_9"]
    assert "like it" not in every and every.count("refused forward/") == 3 and every.count("left alone:") == 2


def test_the_table_does_not_grow_with_the_layers():
    """Scale: a report of 2 and of 64 identical layers (four pairs each, forward and backward) has
    the same lines but for the counts; with ``every_pair`` the table grows with the pairs."""
    from dataclasses import replace

    def report(layers: int) -> Report:
        shapes = [(128, 192, 256), (128, 256, 64), (128, 256, 256), (128, 256, 128)]
        graphs = [GraphReport(g, pairs=[replace(pair(0.04), graph=g, collective=f"c{i}_{j}", m=m, n=n, k=k)
                                        for i in range(layers) for j, (m, n, k) in enumerate(shapes)])
                  for g in ("forward", "backward")]
        return Report(graphs=graphs)

    small, large = format_report(report(2)).splitlines(), format_report(report(64)).splitlines()
    # the count line, the table's header and rule, 8 rows, the summary, the predicted time, the topology,
    # 8 candidates, the legend
    assert len(small) == len(large) == 1 + 2 + 8 + 1 + 1 + 1 + 8 + 4, "\n".join(large)
    assert format_report(report(64), every_pair=True).count("\nforward ") == 256


def test_a_model_compiled_block_by_block_reads_as_one():
    """torchtitan compiles each block on its own: 64 forward graphs of the same four pairs and note
    read as the four rows, one note and one summary with the graphs counted."""
    from dataclasses import replace

    def block(i: int) -> GraphReport:
        return GraphReport("forward", pairs=[replace(pair(0.04), collective=f"c{i}_{j}", n=64 * (j + 1))
                                             for j in range(4)],
                           collectives_before=5, collectives_after=5, notes=["priced as CUDA graph replays"])

    text = format_report(Report(graphs=[block(i) for i in range(64)]))
    assert text.startswith("256 pairs in 4 rows")
    assert "\nnote (forward, 64 graphs): priced as CUDA graph replays\n" in text and text.count("note (") == 1
    assert "\nforward, 64 graphs: 0/256 pairs rewritten, collectives 320->320\n" in text
    every = format_report(Report(graphs=[block(i) for i in range(64)]), every_pair=True)
    assert every.count("note (forward): ") == 64 and every.count("forward: 0/4 pairs rewritten") == 64


def test_the_bottom_line_is_the_pairs_predicted_time_against_all_sequential():
    """Per graph name, the priced pairs' predicted time as decided (a pair kept runs sequentially)
    against all of them sequential; a forced pair (nothing priced) is not counted."""
    from dataclasses import replace

    priced = [{"label": "sequential", "seconds": 2e-5}, {"label": "decompose(d=2)", "seconds": 1e-5}]
    rewritten = replace(pair(0.04), strategy="decompose", parts=2, status="rewritten", candidates=priced,
                        predicted_s=1e-5)
    kept = replace(pair(0.04), collective="c1", m=64, predicted_s=1e-5)  # sequential 10 us
    forced = replace(pair(None), collective="c2", m=16, candidates=[], predicted_s=None, status="rewritten")
    text = format_report(Report(graphs=[GraphReport("forward", pairs=[rewritten, kept, forced])]))
    assert ("predicted time of the pairs (cost model), forward: 20.0us as decided, 30.0us all sequential "
            "(2 pairs, 33% less)") in text, text
    assert "predicted time" not in format_report(Report(graphs=[GraphReport("forward", pairs=[forced])]))
