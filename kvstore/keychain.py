"""Key chains: a call naming one block twice is refused.

Why: a prefix chain never repeats a key (block i's key covers block i-1's, so two equal keys
would be two equal prefixes), yet every block a call names costs the daemon work: a Get naming
one block 65,536 times streamed it 65,536 times, an Acquire pinned it 65,536 times. A request
of 1 MiB must not buy a reply of gigabytes. Checked at C speed (a set of the keys) on the hot
path; only a call that fails pays for finding which key repeats.

Why in steps of STEP keys: one C call over 65,536 keys (building the set, or a list of them)
holds the GIL for tens of milliseconds on a busy machine, and every other call in the daemon,
any tenant's, waits for it. Between steps the interpreter hands the GIL to a waiting thread,
so a tenant sending the largest requests costs the others at most a step's wait.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore_client.common.errors import InvalidArgument

STEP = 2048                   # keys per C-level step (about a millisecond of GIL, or less)


def check_distinct(keys: Sequence[bytes], field: str = "keys") -> None:
    """InvalidArgument naming the first key that repeats an earlier one."""
    seen: set[bytes] = set()
    for i in range(0, len(keys), STEP):
        part = keys[i:i + STEP]
        seen.update(part)
        if len(seen) != i + len(part):
            _first_repeat(keys, i, part, field)


def _first_repeat(keys: Sequence[bytes], start: int, part: Sequence[bytes], field: str) -> None:
    """Raise for the first key of `part` (keys[start:...]) that an earlier key repeats (the
    keys before `start` are distinct among themselves)."""
    earlier: set[bytes] = set()
    for i in range(0, start, STEP):
        earlier.update(keys[i:i + STEP])
    first: dict[bytes, int] = {}
    for n, k in enumerate(part):
        if k in earlier:
            j = 0
            for i in range(0, start, STEP):   # one key's first place: C scans, in steps
                step = list(keys[i:i + STEP])
                if k in step:
                    j = i + step.index(k)
                    break
        else:
            j = first.setdefault(k, start + n)
        if j != start + n:
            raise InvalidArgument(f"{field}[{start + n}] repeats {field}[{j}]: a call names "
                                  "each block once (a prefix chain cannot hold a key twice: "
                                  "each key covers the blocks before it)")
