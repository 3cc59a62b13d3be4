"""The numba kernel behind blockcopy.py: copy the rows of blocks, checksumming each row while
it is still in L1.

Imported only by `blockcopy._build()` (importing numba costs a fraction of a second, the first
compilation a few seconds; `cache=True` keeps the machine code on disk for later processes).

The checksum is the xxhash wheel's own XXH3-64 (its C library exports the streaming API, with
its AVX2 dispatch), called through ctypes from the compiled loop, so the hash is the daemon's
bit for bit and runs at its full speed. Per row: store direction, copy the row into the slot
then feed the slot's row to the hash (L1-hot); load direction, feed the slot's row then copy
it out (L1-hot). Either way every byte crosses memory once.
"""

from __future__ import annotations

import ctypes

import llvmlite.binding as llvm
import numba
import numpy as np
import xxhash._xxhash as _xx
from numba import types as nt

_libxx = ctypes.CDLL(_xx.__file__)
_libc = ctypes.CDLL(None)


def _extern(name: str, lib: ctypes.CDLL, sig: nt.Signature) -> nt.ExternalFunction:
    """A C function the kernel calls by symbol name (so numba can cache the machine code: the
    address is registered again, under the same name, in every process)."""
    llvm.add_symbol(name, ctypes.cast(getattr(lib, name), ctypes.c_void_p).value)
    return nt.ExternalFunction(name, sig)


# Pointers travel as integers (x86-64 and aarch64 pass both in the same registers).
_u64 = nt.uint64
_memcpy = _extern("memcpy", _libc, _u64(_u64, _u64, _u64))
_create = _extern("XXH3_createState", _libxx, _u64())
_free = _extern("XXH3_freeState", _libxx, nt.intc(_u64))
_reset = _extern("XXH3_64bits_reset", _libxx, nt.intc(_u64))
_update = _extern("XXH3_64bits_update", _libxx, nt.intc(_u64, _u64, _u64))
_digest = _extern("XXH3_64bits_digest", _libxx, _u64(_u64))


@numba.njit(nogil=True, cache=True, boundscheck=False)
def move_blocks(ea, pa, eng_blk, eng_row, slot_off, row_bytes, to_slot, do_hash, sums,
                j0, j1):  # pragma: no cover - compiled
    """Blocks j0..j1-1: copy row r of block j between address ea + eng_blk[j] + eng_row[r] and
    pa + slot_off[j] + r*row_bytes (row_bytes each); sums[j] = XXH3-64 of the slot's bytes.

    Addresses, not arrays, because a paged cache's layers are separate allocations; the caller
    (blockcopy.run) has checked every offset against the memory it names.
    Returns 0, or -1 when the hash state could not be allocated (nothing was copied then).
    """
    R = eng_row.shape[0]
    eu = np.uint64(ea)        # uint64 throughout: int64 mixed with uint64 becomes float64
    pu = np.uint64(pa)
    n = np.uint64(row_bytes)
    st = np.uint64(0)
    if do_hash:
        st = _create()
        if st == 0:
            return -1
    for j in range(j0, j1):
        if do_hash:
            _reset(st)
        for r in range(R):
            e = eu + np.uint64(eng_blk[j] + eng_row[r])
            p = pu + np.uint64(slot_off[j] + r * row_bytes)
            if to_slot:
                _memcpy(p, e, n)
                if do_hash:
                    _update(st, p, n)
            else:
                if do_hash:
                    _update(st, p, n)
                _memcpy(e, p, n)
        if do_hash:
            sums[j] = _digest(st)
    if do_hash:
        _free(st)
    return 0
