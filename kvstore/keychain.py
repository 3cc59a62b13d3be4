"""Key chains: a call naming one block twice is refused.

Why: a prefix chain never repeats a key (block i's key covers block i-1's, so two equal keys
would be two equal prefixes), yet every block a call names costs the daemon work: a Get naming
one block 65,536 times streamed it 65,536 times, an Acquire pinned it 65,536 times. A request
of 1 MiB must not buy a reply of gigabytes. Checked at C speed (one set of the keys) on the
hot path; only a call that fails pays for finding which key repeats.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore_client.common.errors import InvalidArgument


def check_distinct(keys: Sequence[bytes], field: str = "keys") -> None:
    """InvalidArgument naming the first key that repeats an earlier one."""
    if len(set(keys)) == len(keys):
        return
    seen: dict[bytes, int] = {}
    for i, k in enumerate(keys):
        j = seen.setdefault(k, i)
        if j != i:
            raise InvalidArgument(f"{field}[{i}] repeats {field}[{j}]: a call names each block "
                                  "once (a prefix chain cannot hold a key twice: each key "
                                  "covers the blocks before it)")
