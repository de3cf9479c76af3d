"""What an eager call's flags hold: the epoch as one bit of four, so that a call's flag operations
are the same every fourth call and a captured CUDA graph can replay them (:mod:`.cuda.replay`).

Why: a stream memory operation takes its value as a number.  With the epoch itself in the flag,
every call writes and awaits new numbers, so a graph captured once would replay stale ones.  A
flag instead holds ``code(e) = 1 << (e % 4)`` (0 before its first write), and a wait for epoch
``t`` holds the stream until ``flag & (code(t) | code(t + 1))`` is nonzero (the driver's AND
wait).  Two graphs differ only in the epoch's residue mod 4 (which also fixes the buffers' parity,
``e % 2``), so four graphs per set of addresses replay every call.

Why that wait means what ``flag >= t`` meant: whenever a rank evaluates a wait for its peer's flag
with target ``t``, the epoch ``v`` last written there lies in ``[t - 1, t + 1]`` (or nothing was
written yet):

* ``v <= t + 1``: the peer writes that flag for call ``t + 2`` only after its own pulls of call
  ``t + 1`` (the double-buffering argument of :mod:`.protocol`), which need something that the
  waiting rank published in call ``t + 1`` (every result depends on every rank's input), which it
  publishes only after its own pulls of call ``t``, and those come after this wait.
* ``v >= t - 1``: the same wait of call ``t - 1``, earlier on the same stream, needed it; flags
  are only raised.  (A wait for an earlier call, ``delta < 0``, exists only in fenced plans,
  which keep the epoch in GPU memory instead.)

Four residues cover even ``[t - 2, t + 1]``: over it ``code(v) & mask(t) != 0`` exactly when
``v >= t``, and a never-written flag (0) satisfies no wait.  The simulator checks the window in
every interleaving it runs (:class:`..simulate.Simulator` with ``coded=True``).
"""
from __future__ import annotations

PERIOD = 4  # residues of the epoch that the codes tell apart (>= the window's 4 epochs)


def code(epoch: int) -> int:
    """What a flag holds once call ``epoch`` (>= 1) has set it."""
    return 1 << (epoch % PERIOD)


def mask(target: int) -> int:
    """The bits a wait for epoch ``target`` accepts: the target's, and the next call's."""
    return code(target) | code(target + 1)


def satisfied(value: int, target: int) -> bool:
    """Whether a flag holding ``value`` releases a wait for epoch ``target`` (none is needed below 1)."""
    return target < 1 or bool(value & mask(target))


def decoded(value: int) -> str:
    """A flag's value for an error message: which residue of the epoch set it last."""
    if value == 0:
        return "never set"
    bits = [r for r in range(PERIOD) if value >> r & 1]
    return f"set by a call of epoch = {bits[0]} mod {PERIOD}" if len(bits) == 1 else f"{value:#x} (not a code)"
