"""The segmented policy's heaps, and which of them each eviction order empties first.

Every resident block has a class (probation, protected, put tail) and an engine hint (normal,
low, high); each (class, hint) pair has a heap of its own, index class * 3 + hint. An order
("mode": protected share, tail rule, hint mode) is then only a choice of which heaps give up
victims first (`roles`), so the tuner can change the order without touching a block.
"""

from __future__ import annotations

# block classes and hints of SegmentedPolicy; heap index = class * 3 + hint
_P, _R, _T = range(3)                     # probation, protected, put tail
_N, _L, _H = range(3)                     # hint: normal, low, high
_HEAPS = 9
_HINT_OF = {"normal": _N, "low": _L, "high": _H}
STRICT, SOFT = 1, 2        # hint modes: every "low" goes first / not for blocks already reused


def roles(tail: bool, hinted: int) -> tuple[tuple[int, ...], ...]:
    """Heaps by role for one mode: (evicted first, probation, protected, all but first)."""
    first: list[int] = []
    prob: list[int] = []
    prot: list[int] = []
    for cls in (_P, _R, _T):
        for hint in (_N, _L, _H):
            h = cls * 3 + hint
            if hinted and hint == _L and (hinted == STRICT or cls != _R):
                first.append(h)             # SOFT: a block already reused outlives "low"
            elif hinted and hint == _H:
                prot.append(h)
            elif cls == _T and tail:
                first.append(h)
            elif cls == _R:
                prot.append(h)
            else:
                prob.append(h)
    return tuple(first), tuple(prob), tuple(prot), tuple(sorted(prob + prot))
