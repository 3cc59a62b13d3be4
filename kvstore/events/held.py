"""What the daemon holds, as a stream starting over announces it: each block with its texts,
parents before children.

Why a module of its own: a start-over (the daemon's start, an overflow, an engine's restart, a
new subscriber) walks the whole index, which the publisher's loop (publisher.py) does nowhere
else. The walk reads the index in slices of WALK_SLICE rows, the store lock held for one slice
at a time and released between them, so stores go on meanwhile; the changes they queue are
replayed after the walk by the publisher's next drain, which gives the true state (a change a
slice already saw is only a repeat). Blocks come out parents first because a router drops a
block whose parent it has not been told of.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..entry import GPU, HOST, SSD
from .pending import PendingTexts
from .recorder import Recorder
from .texts import OWN, VLLM, BlockText

WALK_SLICE = 16384          # index rows read per hold of the store lock

Held = tuple[bytes, tuple[str, ...], BlockText, int]     # gkey, tiers, text, stream mask


def held_blocks(state: Any, recorder: Recorder, pending: PendingTexts,
                vh: dict[bytes, tuple[int, ...]], want: int,
                locked: Callable[[], bool]) -> list[Held] | None:
    """Every block the daemon holds in a namespace published by a stream of the mask `want`,
    with its tiers, its text and the streams of `want` that publish it, parents first. A block
    whose text is not known yet waits in `pending` instead; a vLLM block's hashes go into `vh`
    (announced). None if `locked()` gave up (the publisher is stopping). `state`: the store's
    shared state (kvstore/state.py)."""
    held: list[Held] = []
    start = 0
    index, ns = state.index, recorder.ns
    while start >= 0:
        if not locked():
            return None
        try:
            start, rows = index.held(start, WALK_SLICE)
        finally:
            state.lock.release()
        for g, on_gpu, on_host, on_ssd in rows:
            kind, mask = ns(g[:16])
            if not mask & want:
                continue
            tiers = tuple(t for t, on in ((GPU, on_gpu), (HOST, on_host), (SSD, on_ssd)) if on)
            text = pending.find(g, kind)
            if text is None:
                if kind != OWN:
                    pending.pend(g, kind, tiers)
                continue
            if kind == VLLM:
                vh[g] = text.hashes
            held.append((g, tiers, text, mask & want))
    return parents_first(held)


def parents_first(held: list[Held]) -> list[Held]:
    """`held` ordered so each block comes after the block its text names as parent."""
    by_last = {h[2].hashes[-1]: i for i, h in enumerate(held)}
    done = [False] * len(held)
    order: list[int] = []
    for i in range(len(held)):
        chain = []
        j: int | None = i
        while j is not None and not done[j]:
            done[j] = True
            chain.append(j)
            p = held[j][2].parent
            j = by_last.get(p) if p is not None else None
        order.extend(reversed(chain))
    return [held[i] for i in order]
