"""The numba kernel behind blockcopy.py: copy the rows of blocks, checksumming each row while
it is in L1.

Imported only by `blockcopy._build()` (importing numba costs a fraction of a second, the first
compilation a few seconds; `cache=True` keeps the machine code on disk for later processes).

The checksum is the xxhash wheel's own XXH3-64 (its C library exports the streaming API, with
its AVX2 dispatch), called through ctypes from the compiled loop, so the hash is the daemon's
bit for bit and runs at its full speed.

Per row (a few KiB to 32 KiB): copy it with non-temporal (streaming) stores, then feed the
source row, which the copy just brought into L1, to the hash. An ordinary store first reads the
destination's cache line (write-allocate), so a copy built of small memcpys moves 3 bytes of
memory traffic per byte; streaming stores move 2, and they do not evict the engine's working
set from the caches. glibc's memcpy streams only for copies of many MiB, not for rows.
The hash is of the source: on a load that is the slot (what is verified), on a store the
engine's bytes, which are what lands in the slot unless the engine changes them during the
copy; then the slot no longer matches its checksum, and every read drops it as corrupt.
"""

from __future__ import annotations

import ctypes

import llvmlite.binding as llvm
import numba
import numpy as np
import xxhash._xxhash as _xx
from llvmlite import ir
from numba import types as nt
from numba.core import cgutils
from numba.extending import intrinsic

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


_NT_ALIGN = 32      # bytes per streaming store (and the alignment it needs)


@intrinsic
def _stream_copy(typingctx, dst, src, n):  # pragma: no cover - compiled
    """Copy n bytes (a multiple of 32; dst 32-byte aligned) with non-temporal 32-byte stores.
    On x86-64 these are vmovntdq (or two movntdq without AVX); on aarch64, stnp."""
    sig = nt.void(nt.uint64, nt.uint64, nt.uint64)

    def codegen(context, builder, signature, args):
        d, s, nb = args
        i64 = ir.IntType(64)
        vp = ir.VectorType(i64, 4).as_pointer()
        hint = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        with cgutils.for_range(builder, builder.udiv(nb, ir.Constant(i64, _NT_ALIGN))) as loop:
            off = builder.mul(loop.index, ir.Constant(i64, _NT_ALIGN))
            v = builder.load(builder.inttoptr(builder.add(s, off), vp), align=1)
            st = builder.store(v, builder.inttoptr(builder.add(d, off), vp), align=_NT_ALIGN)
            st.set_metadata("nontemporal", hint)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _store_fence(typingctx):  # pragma: no cover - compiled
    """Order the streaming stores before anything after the kernel (they are weakly ordered:
    the slot must hold its bytes before Commit tells the daemon it does)."""
    sig = nt.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return sig, codegen


@numba.njit(nogil=True, cache=True, boundscheck=False)
def move_blocks(ea, pa, eng_blk, eng_row, slot_off, row_bytes, to_slot, do_hash, sums,
                j0, j1):  # pragma: no cover - compiled
    """Blocks j0..j1-1: copy row r of block j between address ea + eng_blk[j] + eng_row[r] and
    pa + slot_off[j] + r*row_bytes (row_bytes each); sums[j] = XXH3-64 of the block's bytes.

    Addresses, not arrays, because a paged cache's layers are separate allocations; the caller
    (blockcopy.run) has checked every offset against the memory it names.
    Returns 0, or -1 when the hash state could not be allocated (nothing was copied then).
    """
    R = eng_row.shape[0]
    eu = np.uint64(ea)        # uint64 throughout: int64 mixed with uint64 becomes float64
    pu = np.uint64(pa)
    n = np.uint64(row_bytes)
    a = np.uint64(_NT_ALIGN)
    stream = n % a == 0
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
            src, dst = (e, p) if to_slot else (p, e)
            if stream and dst % a == 0:
                _stream_copy(dst, src, n)
            else:
                _memcpy(dst, src, n)
            if do_hash:
                _update(st, src, n)         # the copy just brought src into L1
        if do_hash:
            sums[j] = _digest(st)
    _store_fence()
    if do_hash:
        _free(st)
    return 0
