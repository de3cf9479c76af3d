"""A run of copies a fused call issues back to back, as few copy-engine copies as its addresses allow.

Why: through host memory each copy is a node a replay graph's launch pays ~1.3-2 us of host for,
whatever its size (``benchmarks/results/graph_node_probe``), and an eager call ~6-8 us for each
``cuMemcpyAsync``.  A round of pulls (:func:`..protocol.grouped_pulls`) reads the same rows of
every peer's host mirror, which lie one arena stride apart (:mod:`.host_memory`), into rows or
staging slots that also step evenly; a 2D copy (``cuMemcpy2DAsync``: ``height`` lines of
``width`` bytes, each pitch apart) moves such a progression in one go.  Pure arithmetic on
addresses, so it is tested without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

MAX_PITCH = (1 << 31) - 1  # the driver refuses longer pitches (CU_DEVICE_ATTRIBUTE_MAX_PITCH on every GPU seen)


@dataclass(frozen=True)
class Strided:
    """``height`` copies of ``width`` bytes: line ``i`` from ``src + i * src_pitch`` to ``dst + i * dst_pitch``."""

    dst: int
    src: int
    width: int
    height: int = 1
    dst_pitch: int = 0
    src_pitch: int = 0


def strided(copies: list[tuple[int, int, int]]) -> list[Strided]:
    """``(dst, src, nbytes)`` copies, independent of each other (no copy reads what another
    writes), as few :class:`Strided` copies: in the order of their sources, consecutive copies of
    one size whose sources and destinations each step by one pitch (at least the size, so that
    no two lines overlap, and at most :data:`MAX_PITCH`) become one."""
    out: list[Strided] = []
    for dst, src, n in sorted(copies, key=lambda c: c[1]):
        if out and out[-1].width == n:
            last = out[-1]
            if last.height == 1:
                dst_pitch, src_pitch = dst - last.dst, src - last.src
                if n <= dst_pitch <= MAX_PITCH and n <= src_pitch <= MAX_PITCH:
                    out[-1] = replace(last, height=2, dst_pitch=dst_pitch, src_pitch=src_pitch)
                    continue
            elif (dst == last.dst + last.height * last.dst_pitch
                  and src == last.src + last.height * last.src_pitch):
                out[-1] = replace(last, height=last.height + 1)
                continue
        out.append(Strided(dst, src, n))
    return out
