"""The machine the cost model plans for: its interconnect (``Topology``: presets, files, detection),
its GPUs' datasheets and the figures a calibration measured on it.  Pure description: it prices
nothing (that is ``cost``) and imports nothing of the rest of compass_fx.

    from compass_fx.machine import Topology
    topo = Topology.preset("a6000-nvlink-pairs-pcie-8")      # or Topology.from_file(...), .detect()

Layers, each importing only those above it: ``links`` (link kinds and their figures), ``gpus``
(datasheets), ``calibration`` (measured figures), ``presets`` (built-in machines as graphs),
``topology`` (the Topology), ``detect`` (reading this machine into a Topology).
"""
from .calibration import gpu_spec, load_calibration, use_calibration
from .detect import detect_topology
from .gpus import GPUS, GpuSpec
from .topology import Topology, set_detector

set_detector(detect_topology)  # Topology.detect() reads this machine through detection

__all__ = ["GPUS", "GpuSpec", "Topology", "gpu_spec", "load_calibration", "use_calibration"]
