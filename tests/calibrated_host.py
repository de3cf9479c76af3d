"""A calibration file that says how this host issues fused calls, for the cost model's tests."""
import contextlib
from pathlib import Path


@contextlib.contextmanager
def calibrated_fused_host(path: Path, fused_host: dict | None):
    """Price under a calibration of an H200 whose ``compass-fx calibrate`` measured ``fused_host``
    (its launches, ``{"launch_s": ...}``, and optionally its dispatch), as ``calibrate`` writes it;
    ``None``: a calibration that measured no host."""
    from compass_fx.machine.calibration import gpu_spec, use_calibration, write_calibration

    extra = {"device": "NVIDIA H200", **({"fused_host": fused_host} if fused_host else {})}
    write_calibration(path, [gpu_spec("H200")], extra)
    with use_calibration(path):
        yield
