"""Property tests of the ring, double-ring and direct schedules for W = 1..16 (pure Python)."""
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compass_fx.kernels.schedules import (SCHEDULES, Piece, all_gather_schedule, parts_of,
                                          reduce_scatter_schedule, split_rows)

WORLDS = range(1, 17)


def _check_pairing(scheds):
    """Every send at step s has exactly one matching receive on the peer at step s, and back."""
    w = len(scheds)
    n_steps = {len(s.steps) for s in scheds}
    assert len(n_steps) == 1, "ranks disagree on the number of steps"
    for step in range(n_steps.pop()):
        sends = Counter((r, t.peer, t.piece) for r in range(w) for t in scheds[r].steps[step].sends)
        recvs = Counter((t.peer, r, t.piece) for r in range(w) for t in scheds[r].steps[step].recvs)
        assert sends == recvs, f"step {step}: sends and receives do not pair up"
        assert all(c == 1 for c in sends.values())
        assert all(src != dst for src, dst, _ in sends)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("w", WORLDS)
def test_all_gather_every_piece_once(name, w):
    scheds = [all_gather_schedule(name, w, r) for r in range(w)]
    _check_pairing(scheds)
    parts = parts_of(name)
    everything = {Piece(b, p) for b in range(w) for p in range(parts)}
    for r, sch in enumerate(scheds):
        assert sch.rank == r and sch.world_size == w and sch.parts == parts
        received = Counter(t.piece for s in sch.steps for t in s.recvs)
        assert all(c == 1 for c in received.values()), "a piece arrived twice"
        assert set(received) == everything - {Piece(r, p) for p in range(parts)}
        # consume order: every piece exactly once, own block first, then in arrival order
        assert sorted(sch.order) == sorted(everything)
        arrival = sch.arrival_step()
        own = [p for p in sch.order if p.block == r]
        assert sch.order[:parts] == tuple(own)
        assert [arrival[p] for p in sch.order[parts:]] == sorted(arrival[p] for p in sch.order[parts:])


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("w", WORLDS)
def test_all_gather_simulation_only_sends_what_is_held(name, w):
    scheds = [all_gather_schedule(name, w, r) for r in range(w)]
    held = [{Piece(r, p) for p in range(parts_of(name))} for r in range(w)]
    for step in range(len(scheds[0].steps)):
        for r in range(w):
            for t in scheds[r].steps[step].sends:
                assert t.piece in held[r], f"rank {r} sends {t.piece} before holding it"
        for r in range(w):
            held[r] |= {t.piece for t in scheds[r].steps[step].recvs}
    assert all(len(h) == w * parts_of(name) for h in held)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("w", WORLDS)
def test_reduce_scatter_every_contribution_summed_once(name, w):
    scheds = [reduce_scatter_schedule(name, w, r) for r in range(w)]
    _check_pairing(scheds)
    parts = parts_of(name)
    everything = {Piece(b, p) for b in range(w) for p in range(parts)}
    # acc[r][piece] = multiset of ranks whose partial product is in rank r's running sum
    acc = [{pc: Counter({r: 1}) for pc in everything} for r in range(w)]
    sent = [set() for _ in range(w)]
    for r, sch in enumerate(scheds):
        assert sorted(sch.order) == sorted(everything)
        assert sch.order[-parts:] == tuple(Piece(r, p) for p in range(parts)), "own block last"
        # pieces are produced in the order the steps send them
        sends = [t.piece for s in sch.steps for t in s.sends]
        assert list(sch.order[:len(sends)]) == sends
    for step in range(len(scheds[0].steps)):
        messages = []
        for r in range(w):
            for t in scheds[r].steps[step].sends:
                assert t.piece not in sent[r], "a running sum was sent twice"
                sent[r].add(t.piece)
                messages.append((t.peer, t.piece, acc[r][t.piece]))
                acc[r][t.piece] = Counter()
        for dst, piece, contrib in messages:
            acc[dst][piece] += contrib
    for r in range(w):
        for p in range(parts):
            assert acc[r][Piece(r, p)] == Counter(range(w)), f"rank {r} part {p}"
        # every other piece's contributions left this rank exactly once
        assert sent[r] == everything - {Piece(r, p) for p in range(parts)}
        assert all(not acc[r][pc] for pc in sent[r])


@pytest.mark.parametrize("w", [2, 3, 8, 16])
def test_double_ring_halves_steps_of_each_half(w):
    """Both directions of every link carry a half each step: r sends to both neighbours."""
    for r in range(w):
        for sch in (all_gather_schedule("double_ring", w, r), reduce_scatter_schedule("double_ring", w, r)):
            for step in sch.steps:
                peers = sorted(t.peer for t in step.sends)
                assert peers == sorted([(r + 1) % w, (r - 1) % w])
                assert {t.piece.part for t in step.sends} == {0, 1}


def test_unknown_schedule_names_the_argument():
    with pytest.raises(ValueError, match="schedule"):
        all_gather_schedule("tree", 4, 0)
    with pytest.raises(ValueError, match="schedule"):
        reduce_scatter_schedule("", 4, 0)
    with pytest.raises(ValueError):
        all_gather_schedule("ring", 4, 4)


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(0, 1000), parts=st.integers(1, 4))
def test_split_rows_covers_block(rows, parts):
    spans = split_rows(rows, parts)
    assert len(spans) == parts and spans[0][0] == 0 and spans[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    sizes = [b - a for a, b in spans]
    assert max(sizes) - min(sizes) <= 1


@settings(max_examples=100, deadline=None)
@given(w=st.integers(1, 16), data=st.data())
def test_neighbours_agree_random_rank(w, data):
    name = data.draw(st.sampled_from(SCHEDULES))
    r = data.draw(st.integers(0, w - 1))
    for make in (all_gather_schedule, reduce_scatter_schedule):
        mine = make(name, w, r)
        for i, step in enumerate(mine.steps):
            for t in step.sends:
                theirs = make(name, w, t.peer).steps[i].recvs
                assert any(x.peer == r and x.piece == t.piece for x in theirs)


def test_ring_and_direct_are_the_same_at_world_two():
    """At W = 2 the ring and the direct schedule move the same pieces between the same ranks in the
    same order (test_numerics runs the fused operators' ring only at W = 4 for that reason)."""
    from compass_fx.kernels.schedules import all_gather_schedule, reduce_scatter_schedule

    for make in (all_gather_schedule, reduce_scatter_schedule):
        for rank in (0, 1):
            ring, direct = make("ring", 2, rank), make("direct", 2, rank)
            assert ring.steps == direct.steps and ring.order == direct.order


def test_distinct_schedules_drop_the_ring_only_where_it_is_direct():
    """The cost model prices one operator per distinct set of transfers: at two ranks the ring
    goes, under every world size above it stays; the CUDA plans of the two are the same too."""
    from compass_fx.kernels.protocol import all_gather_plan, reduce_scatter_plan
    from compass_fx.kernels.schedules import distinct_schedules

    assert distinct_schedules(SCHEDULES, 2) == ("double_ring", "direct")
    assert distinct_schedules(("ring",), 2) == ("ring",)  # nothing to stand in for it
    assert distinct_schedules(("ring", "double_ring"), 2) == ("ring", "double_ring")
    for w in (3, 4, 8):
        assert distinct_schedules(SCHEDULES, w) == SCHEDULES
    for rank in (0, 1):
        for split in (1, 3):
            assert (all_gather_plan("ring", 2, rank, 64, 2, split).commands
                    == all_gather_plan("direct", 2, rank, 64, 2, split).commands)
            assert (reduce_scatter_plan("ring", 2, rank, 64, split).commands
                    == reduce_scatter_plan("direct", 2, rank, 64, split).commands)
    with pytest.raises(ValueError, match="schedule"):
        distinct_schedules(("zigzag",), 2)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_refined_schedules_move_every_sub_piece_once(kind, schedule):
    """Cutting each piece into sub-pieces keeps who talks to whom and when; every sub-piece of a
    piece travels in that piece's step, and the order keeps the pieces' order."""
    from compass_fx.kernels.schedules import all_gather_schedule, reduce_scatter_schedule, refined

    make = all_gather_schedule if kind == "all_gather" else reduce_scatter_schedule
    for world in (2, 3, 4):
        for rank in range(world):
            base = make(schedule, world, rank)
            fine = refined(base, 3)
            assert fine.parts == 3 * base.parts and len(fine.steps) == len(base.steps)
            for s, f in zip(base.steps, fine.steps):
                assert [(t.piece.block, t.piece.part * 3 + i, t.peer) for t in s.sends for i in range(3)] == \
                    [(t.piece.block, t.piece.part, t.peer) for t in f.sends]
                assert len(f.recvs) == 3 * len(s.recvs)
            assert [(p.block, p.part // 3) for p in fine.order] == [(p.block, p.part) for p in base.order for _ in range(3)]
            assert refined(base, 1) is base
    with pytest.raises(ValueError, match="split"):
        refined(make(schedule, 2, 0), 0)
