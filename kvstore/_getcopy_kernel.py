"""The numba kernel behind getcopy.py: copy committed blocks out of the host pool into a Get
reply and hash the copy while it is still in L1.

Imported only by `getcopy._build()`. It calls the xxhash wheel's XXH3-64 entry points through
kvstore_client/common/kernel_externs.py, as the SDK's block-copy kernel does (so the hash is the
commit checksum bit for bit).

Why the copy is hashed, not the slot: the slot is mapped read-write by clients, so it may change
between a check and the copy that is sent; only a hash of the bytes that leave says something
about them. Why per chunk: a chunk (16 KiB) is copied with ordinary stores, which leave it in
L1, and hashed right away, so the check costs no second pass over memory (a whole 8 MiB batch
hashed after its copy is read back from L3 or RAM).
"""

from __future__ import annotations

import numba
import numpy as np
from kvstore_client.common.kernel_externs import memcpy as _memcpy
from kvstore_client.common.kernel_externs import xxh3_create as _create
from kvstore_client.common.kernel_externs import xxh3_digest as _digest
from kvstore_client.common.kernel_externs import xxh3_free as _free
from kvstore_client.common.kernel_externs import xxh3_reset as _reset
from kvstore_client.common.kernel_externs import xxh3_update as _update


@numba.njit(nogil=True, cache=True, boundscheck=False)
def copy_check(dst, src, dst_off, lens, want, chunk):  # pragma: no cover - compiled
    """Copy block j (lens[j] bytes at address src[j]) to dst + dst_off[j] and compare the
    XXH3-64 of the copy with want[j] (every value, 0 included: kvstore/verify.py); hashing off
    when chunk == 0.

    Returns the index of the first block whose copy does not match (it and the blocks after it
    are not, or not wholly, copied), len(src) when all match, or -1 when the hash state could
    not be allocated (nothing copied then).
    """
    n = src.shape[0]
    d0 = np.uint64(dst)
    if chunk == 0:
        for j in range(n):
            _memcpy(d0 + np.uint64(dst_off[j]), np.uint64(src[j]), np.uint64(lens[j]))
        return n
    st = _create()
    if st == 0:
        return -1
    c = np.uint64(chunk)
    for j in range(n):
        _reset(st)
        s = np.uint64(src[j])
        d = d0 + np.uint64(dst_off[j])
        m = np.uint64(lens[j])
        off = np.uint64(0)
        while off < m:
            k = c if m - off > c else m - off
            _memcpy(d + off, s + off, k)
            _update(st, d + off, k)        # the copy, just written, still in L1
            off += k
        if _digest(st) != np.uint64(want[j]):
            _free(st)
            return j
    _free(st)
    return n
