"""The fused operators' watchdog: a wait that outlives the timeout is reported, released and
turns every later call into a RuntimeError (no GPU needed: the pending call is a stand-in)."""
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
