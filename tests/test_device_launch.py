"""Replay graphs launched by the GPU (``kernels/cuda/device_launch.py``): the switch, how it sets the
replay graphs' waits, and where the device runtime library is looked for.  The launch itself needs a
GPU (``benchmarks/device_graph_launch.py``, ``fused_host_time.py``, ``fused_host_stress.py``); the
launcher's source is compile-checked in ``tests/test_graph_flags.py``."""
import pytest

from compass_fx.kernels.cuda import device_launch, replay


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("COMPASS_REPLAY_LAUNCH", "COMPASS_REPLAY_WAITS", "COMPASS_CUDADEVRT", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(device_launch, "_off", [])


def test_host_launch_and_batched_stream_waits_by_default(monkeypatch):
    assert not device_launch.wanted()
    assert not replay.waits_as_kernels() and replay.wait_batches() and replay.wait_mode() == "batch"
    monkeypatch.setenv("COMPASS_REPLAY_WAITS", "Stream")  # a node per wait
    assert replay.wait_mode() == "stream" and not replay.wait_batches() and not replay.waits_as_kernels()
    monkeypatch.setenv("COMPASS_REPLAY_WAITS", "batches")
    with pytest.raises(ValueError, match="COMPASS_REPLAY_WAITS must be batch, stream or kernel"):
        replay.wait_mode()


def test_device_launch_makes_the_waits_kernels_unless_told_otherwise(monkeypatch):
    monkeypatch.setenv("COMPASS_REPLAY_LAUNCH", "Device")
    assert device_launch.wanted()
    assert replay.waits_as_kernels()  # a device graph cannot hold a stream wait
    monkeypatch.setenv("COMPASS_REPLAY_WAITS", "stream")  # asked for: kept (the graph then falls back)
    assert not replay.waits_as_kernels()


def test_a_bad_setting_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("COMPASS_REPLAY_LAUNCH", "gpu")
    with pytest.raises(ValueError, match="COMPASS_REPLAY_LAUNCH must be host or device"):
        device_launch.wanted()


def test_once_turned_off_the_host_launches_with_one_warning(monkeypatch):
    monkeypatch.setenv("COMPASS_REPLAY_LAUNCH", "device")
    with pytest.warns(RuntimeWarning, match="launched from the host: no library"):
        device_launch.turn_off("no library")
    assert not device_launch.wanted()
    device_launch.turn_off("again")  # no second warning, the first reason kept
    assert device_launch._off == ["no library"]


def test_the_device_runtime_is_looked_for_where_named_first(tmp_path, monkeypatch):
    named = tmp_path / "libcudadevrt.a"
    home = tmp_path / "cuda" / "lib64"
    home.mkdir(parents=True)
    (home / "libcudadevrt.a").write_bytes(b"!<arch>\n")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.setenv("COMPASS_CUDADEVRT", str(named))
    places = device_launch.cudadevrt_candidates()
    assert places[0] == str(named) and str(home / "libcudadevrt.a") in places
    assert device_launch.find_cudadevrt() == str(home / "libcudadevrt.a")  # the named one does not exist
    named.write_bytes(b"!<arch>\n")
    assert device_launch.find_cudadevrt() == str(named)


def test_without_a_gpu_the_launcher_is_not_available_and_says_why(monkeypatch):
    monkeypatch.setenv("COMPASS_REPLAY_LAUNCH", "device")
    monkeypatch.setattr(device_launch, "find_cudadevrt", lambda: None)
    device_launch._launch_function.cache_clear()
    with pytest.warns(RuntimeWarning, match="libcudadevrt.a"):
        assert not device_launch.available(0)
    assert not device_launch.wanted()
    device_launch._launch_function.cache_clear()
