"""The fused operators' watchdog: a wait that outlives the timeout is reported, released and
turns every later call into a RuntimeError (no GPU needed: the pending call is a stand-in)."""
import threading
import time

import pytest

from compass_fx.kernels.cuda import watchdog


class _Never:
    def query(self):
        return False


class _Done:
    def query(self):
        return True


def test_a_stuck_call_is_reported_released_and_raises_later(monkeypatch, caplog):
    monkeypatch.setenv("COMPASS_FUSED_TIMEOUT_S", "0.05")
    dog = watchdog.Watchdog(0)
    released = []
    w = watchdog.Watched(lambda epoch: (f"op waits in call {epoch} for rank 1", lambda: released.append(epoch)))
    dog.watched.append(w)
    w.pending += [watchdog._Pending(1, _Done(), 0.0), watchdog._Pending(2, _Never(), 0.0)]
    dog.scan()
    assert released == [2] and len(w.pool) == 1  # the finished call's event is kept for reuse
    assert "op waits in call 2 for rank 1" in caplog.text
    with pytest.raises(RuntimeError, match="call 2 for rank 1.*COMPASS_FUSED_TIMEOUT_S=0.05"):
        dog.check_failed()


def test_calls_within_the_timeout_are_left_alone(monkeypatch):
    monkeypatch.setenv("COMPASS_FUSED_TIMEOUT_S", "3600")
    dog = watchdog.Watchdog(0)
    w = watchdog.Watched(lambda epoch: pytest.fail("diagnosed a call that is not late"))
    dog.watched.append(w)
    w.pending.append(watchdog._Pending(1, _Never(), __import__("time").monotonic()))
    dog.scan()
    dog.check_failed()


def test_a_bad_timeout_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("COMPASS_FUSED_TIMEOUT_S", "-1")
    with pytest.raises(ValueError, match="COMPASS_FUSED_TIMEOUT_S must be > 0"):
        watchdog.timeout_s()


def test_a_diagnosis_that_hangs_still_ends_in_the_error(monkeypatch, caplog):
    """Reading a stuck call's flags takes GPU work that a blocked hardware queue can hold up: the
    watchdog then reports the call without the detail instead of hanging with it."""
    monkeypatch.setenv("COMPASS_FUSED_TIMEOUT_S", "0.05")
    monkeypatch.setattr(watchdog, "DIAGNOSE_S", 0.2)
    dog = watchdog.Watchdog(0)
    never = threading.Event()
    w = watchdog.Watched(lambda epoch: never.wait() and ("unreachable", None),
                         what="compass::matmul_reduce_scatter on rank 1")
    dog.watched.append(w)
    w.pending.append(watchdog._Pending(3, _Never(), 0.0))
    started = time.monotonic()
    dog.scan()
    assert time.monotonic() - started < 5
    never.set()
    with pytest.raises(RuntimeError, match=r"matmul_reduce_scatter on rank 1: call 3 .*could not be read"):
        dog.check_failed()
    assert "could not be read" in caplog.text


def test_a_release_that_hangs_is_logged(monkeypatch, caplog):
    monkeypatch.setenv("COMPASS_FUSED_TIMEOUT_S", "0.05")
    monkeypatch.setattr(watchdog, "DIAGNOSE_S", 0.2)
    dog = watchdog.Watchdog(0)
    never = threading.Event()
    w = watchdog.Watched(lambda epoch: (f"op waits in call {epoch} for rank 0", never.wait))
    dog.watched.append(w)
    w.pending.append(watchdog._Pending(4, _Never(), 0.0))
    dog.scan()
    never.set()
    assert "op waits in call 4 for rank 0" in caplog.text and "could not be released" in caplog.text
    with pytest.raises(RuntimeError, match="call 4 for rank 0"):
        dog.check_failed()


def test_a_captured_wait_that_timed_out_is_reported(caplog):
    """A call replayed from a CUDA graph bounds its own waits on the GPU and stores which one timed
    out in a host word; the watchdog turns that into the error every later call raises."""
    import torch

    dog = watchdog.Watchdog(0)
    status = torch.zeros(1, dtype=torch.int32)
    dog.statuses.append((status, lambda code: f"captured wait {code} on rank 0 for rank 1's rows"))
    dog.scan()
    dog.check_failed()  # nothing timed out yet
    status[0] = 3
    dog.scan()
    assert "captured wait 3 on rank 0 for rank 1's rows" in caplog.text
    with pytest.raises(RuntimeError, match="^captured wait 3 on rank 0 for rank 1's rows$"):
        dog.check_failed()


def test_a_captured_waits_code_names_the_wait_the_peer_and_the_timeout():
    """What a workspace says of its captured wait that stored ``code`` (the command's position + 1):
    the waiting rank, the peer and what it waited for, and that the GPU stopped at the timeout."""
    from types import SimpleNamespace

    from compass_fx.kernels.cuda.impl import _Workspace
    from compass_fx.kernels.protocol import WaitFlag, reduce_scatter_plan

    plan = reduce_scatter_plan("direct", 4, 2, 64)
    code = next(i for i, c in enumerate(plan.commands) if isinstance(c, WaitFlag)) + 1
    wait = plan.commands[code - 1]
    workspace = SimpleNamespace(plan=plan, rank=2, dog=SimpleNamespace(timeout=7.0))
    message = _Workspace._explain_timeout(workspace, code)
    assert message.startswith("compass::matmul_reduce_scatter on rank 2, captured in a CUDA graph, waited for rank "
                              f"{wait.peer}'s {plan.slot_names[wait.slot]} (flag {wait.slot})")
    assert "COMPASS_FUSED_TIMEOUT_S=7 s and stopped the GPU's work" in message


def test_a_refused_device_launch_is_reported_with_its_cuda_error():
    """A replay graph's launcher that the device runtime refuses stores the CUDA error in a watched
    host word before it traps; the watchdog makes that the process's error."""
    import torch

    from compass_fx.kernels.cuda import device_launch

    dog = watchdog.Watchdog(0)
    word = torch.zeros(1, dtype=torch.int32)
    dog.statuses.append((word, device_launch.explain_refusal))
    dog.scan()
    dog.check_failed()
    word[0] = 201
    dog.scan()
    with pytest.raises(RuntimeError, match="refused to launch a replay graph .*CUDA error 201.*COMPASS_REPLAY_LAUNCH"):
        dog.check_failed()


def test_a_finished_calls_event_is_reused_before_the_next_scan():
    """Back-to-back calls take the oldest pending call's event once it has finished (the scan runs
    about once a second; a new event per call would cost the host a creation each)."""
    dog = watchdog.Watchdog(0)
    w = watchdog.Watched(lambda epoch: pytest.fail("diagnosed"))
    done, never = _Done(), _Never()
    w.pending += [watchdog._Pending(1, done, 0.0), watchdog._Pending(2, never, 0.0)]
    assert dog.reusable(w) is done and [p.epoch for p in w.pending] == [2]
    assert dog.reusable(w) is None  # call 2 still runs: its event is not handed out
    w.pool.append(done)
    assert dog.reusable(w) is done and not w.pool


def _progress(issued_epochs, finished):
    """A :class:`watchdog.Progress` over a CPU word: replays of ``issued_epochs``, ``finished`` done."""
    import torch

    p = watchdog.Progress(torch.zeros(1, dtype=torch.int32))
    for i, epoch in enumerate(issued_epochs):
        p.epochs[i % p.RING] = epoch
    p.issued = len(issued_epochs)
    p.word[0] = finished
    return p


def test_a_replayed_call_without_progress_is_reported_by_its_epoch(monkeypatch, caplog):
    """Replayed calls register no event: the graph's last node counts them in a host word, and the
    oldest unfinished one (its epoch noted in a ring when issued) is late once the count has not
    moved for the timeout."""
    monkeypatch.setenv("COMPASS_FUSED_TIMEOUT_S", "0.05")
    dog = watchdog.Watchdog(0)
    released = []
    w = watchdog.Watched(lambda epoch: (f"op waits in call {epoch} for rank 1", lambda: released.append(epoch)))
    dog.watched.append(w)
    w.progress = _progress([5, 6, 8], finished=1)
    dog.scan()  # the count is seen for the first time: no verdict yet
    dog.check_failed()
    time.sleep(0.1)
    dog.scan()
    assert released == [6] and "op waits in call 6 for rank 1" in caplog.text
    with pytest.raises(RuntimeError, match="call 6 for rank 1.*COMPASS_FUSED_TIMEOUT_S=0.05"):
        dog.check_failed()


def test_replayed_calls_that_progress_or_finished_are_left_alone(monkeypatch):
    monkeypatch.setenv("COMPASS_FUSED_TIMEOUT_S", "0.05")
    dog = watchdog.Watchdog(0)
    w = watchdog.Watched(lambda epoch: pytest.fail("diagnosed a call that is not late"))
    dog.watched.append(w)
    w.progress = p = _progress([1, 2, 3, 4], finished=0)
    for done in (1, 2, 3):  # slow, but moving: each scan sees a new count
        dog.scan()
        time.sleep(0.1)
        p.word[0] = done
    dog.scan()
    p.word[0] = 4  # all finished: nothing outstanding however long it stays so
    time.sleep(0.1)
    dog.scan()
    dog.scan()
    dog.check_failed()


def test_the_older_of_an_issued_and_a_replayed_late_call_is_diagnosed(monkeypatch):
    monkeypatch.setenv("COMPASS_FUSED_TIMEOUT_S", "0.05")
    dog = watchdog.Watchdog(0)
    seen = []
    w = watchdog.Watched(lambda epoch: seen.append(epoch) or (f"call {epoch}", None))
    dog.watched.append(w)
    w.pending.append(watchdog._Pending(9, _Never(), time.monotonic()))  # issued after the replays below
    w.progress = _progress([7, 8], finished=0)
    dog.scan()
    time.sleep(0.1)
    dog.scan()
    assert seen == [7]


def test_replays_stay_on_one_stream_and_within_the_ring():
    """A plain increment on the GPU counts exactly only while a workspace's replays run one after
    another: a replay on another stream waits (is issued instead) until the earlier ones finished;
    and at most RING - 1 are outstanding, so the oldest one's epoch is still in the ring."""
    p = _progress([], finished=0)
    assert p.room(11) and p.stream == 11
    p.issued = 2
    assert p.room(11) and not p.room(12) and p.stream == 11
    p.word[0] = 2
    assert p.room(12) and p.stream == 12
    p.issued = 2 + p.RING - 1
    assert not p.room(12)
    p.word[0] = 3
    assert p.room(12)
    p.issued, p.word[0] = 2 ** 32 + 5, 3  # the word wraps at 2**32 like the host's count modulo it
    assert p.outstanding() == 2 and p.room(12)
