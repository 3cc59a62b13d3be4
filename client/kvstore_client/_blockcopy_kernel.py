"""The numba kernel behind blockcopy.py: copy the rows of blocks, checksumming each row while
it is in L1.

Imported only by `blockcopy._build()` (importing numba costs a fraction of a second, the first
compilation a few seconds; `cache=True` keeps the machine code on disk for later processes).

The checksum is XXH3-64, the daemon's bit for bit. Where a row is a whole number of XXH3's
1 KiB blocks (every 16-token KV layout with 64+ head dims), `move_blocks_x3` computes it inside
the copy, one load per stripe (see the section at the end); otherwise `move_blocks` calls the
xxhash wheel's own C library (streaming API, AVX2 dispatch) through ctypes after each row.

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

import numba
import numpy as np
from llvmlite import ir
from numba import types as nt
from numba.core import cgutils
from numba.extending import intrinsic

from .common.kernel_externs import memcpy as _memcpy
from .common.kernel_externs import xxh3_create as _create
from .common.kernel_externs import xxh3_digest as _digest
from .common.kernel_externs import xxh3_free as _free
from .common.kernel_externs import xxh3_reset as _reset
from .common.kernel_externs import xxh3_update as _update

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


# ------------------------------------------------------------------ copy and XXH3 in one pass
# Where every row is a whole number of XXH3's 1 KiB blocks (rows of 16-token KV blocks are
# 4-64 KiB), the kernel below runs XXH3-64's long-input loop itself, stripe by stripe inside
# the copy: each 64-byte stripe is loaded once, mixed into the accumulators and streamed to
# the destination, so the hash's arithmetic overlaps the copy's memory traffic instead of
# running as a pass of its own over the row afterwards (at two threads, where the copy is
# bound by memory bandwidth, the separate pass cost ~25% of a 2 MiB block's copy time). The
# result is XXH3-64 with the default secret and seed, bit for bit (tests/test_blockcopy.py
# checks it against the xxhash library on every path).

_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")


def _words(offset: int, n: int) -> np.ndarray:
    return np.frombuffer(_SECRET[offset:offset + 8 * n], dtype="<u8").astype(np.uint64)


_SEC = _words(0, 24)          # stripe s of a 1 KiB block mixes words s..s+7
_LAST = _words(121, 8)        # the input's last stripe (XXH_SECRET_LASTACC_START = 7)
_MERGE = _words(11, 8)        # XXH_SECRET_MERGEACCS_START
_INIT = np.array([0xC2B2AE3D, 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                  0x85EBCA77C2B2AE63, 0x85EBCA77, 0x27D4EB2F165667C5, 0x9E3779B1],
                 dtype=np.uint64)
X3_BLOCK = 1024               # XXH3's block with the default secret: 16 stripes of 64 bytes
_M32 = np.uint64(0xFFFFFFFF)


@intrinsic
def _x3_chunk(typingctx, acc, src, dst, key, key15, scramble):  # pragma: no cover - compiled
    """One XXH3 block (1 KiB, 16 stripes) of src: mixed into the 8 accumulators at `acc`
    (XXH3_accumulate_512 per stripe, stripe t with the secret words at key + 8t, the last with
    those at key15) and streamed to dst (two 32-byte non-temporal stores per stripe); then
    XXH3_scrambleAcc with the words at key + 128 when `scramble`. Written as vector IR so the
    8 lanes are one or two SIMD registers and each stripe is loaded from memory once."""
    sig = nt.void(nt.uint64, nt.uint64, nt.uint64, nt.uint64, nt.uint64, nt.boolean)

    def codegen(context, builder, signature, args):
        acc_a, s, d, k, k15, scr = args
        i64 = ir.IntType(64)
        v8 = ir.VectorType(i64, 8)
        v4 = ir.VectorType(i64, 4)
        hint = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])

        def vec(x: int) -> ir.Constant:
            return ir.Constant(v8, [x] * 8)

        def load8(addr):
            return builder.load(builder.inttoptr(addr, v8.as_pointer()), align=1)

        def at(base, off: int):
            return builder.add(base, ir.Constant(i64, off))

        swap = ir.Constant(ir.VectorType(ir.IntType(32), 8), [1, 0, 3, 2, 5, 4, 7, 6])
        lo_mask, sh32 = vec(0xFFFFFFFF), vec(32)
        a = load8(acc_a)
        for t in range(16):
            v = load8(at(s, 64 * t))
            kk = load8(at(k, 8 * t) if t < 15 else k15)
            dk = builder.xor(v, kk)
            prod = builder.mul(builder.and_(dk, lo_mask), builder.lshr(dk, sh32))
            sw = builder.shuffle_vector(v, v, swap)
            a = builder.add(builder.add(a, sw), prod)
            for h in range(2):
                half = builder.shuffle_vector(
                    v, v, ir.Constant(ir.VectorType(ir.IntType(32), 4),
                                      list(range(4 * h, 4 * h + 4))))
                st = builder.store(half, builder.inttoptr(at(d, 64 * t + 32 * h),
                                                          v4.as_pointer()), align=32)
                st.set_metadata("nontemporal", hint)
        x = builder.xor(a, builder.lshr(a, vec(47)))
        x = builder.xor(x, load8(at(k, 128)))
        x = builder.mul(x, vec(0x9E3779B1))
        a = builder.select(scr, x, a)
        builder.store(a, builder.inttoptr(acc_a, v8.as_pointer()), align=8)
        return context.get_dummy_value()
    return sig, codegen


@numba.njit(nogil=True, cache=True, inline="always")
def _fold(a, b):  # pragma: no cover - compiled
    """The 128-bit product of a and b, its halves xored (XXH3_mul128_fold64)."""
    s32 = np.uint64(32)
    lo_lo = (a & _M32) * (b & _M32)
    hi_lo = (a >> s32) * (b & _M32)
    lo_hi = (a & _M32) * (b >> s32)
    hi_hi = (a >> s32) * (b >> s32)
    cross = (lo_lo >> s32) + (hi_lo & _M32) + lo_hi
    upper = (hi_lo >> s32) + (cross >> s32) + hi_hi
    lower = (cross << s32) | (lo_lo & _M32)
    return lower ^ upper


@numba.njit(nogil=True, cache=True, boundscheck=False)
def move_blocks_x3(ea, pa, eng_blk, eng_row, slot_off, row_bytes, to_slot, sums, sec, last,
                   merge, init, j0, j1):  # pragma: no cover - compiled
    """move_blocks with do_hash, for row_bytes a multiple of X3_BLOCK and a 32-byte aligned
    destination: the copy and XXH3-64 of each block in one pass (see above)."""
    R = eng_row.shape[0]
    eu = np.uint64(ea)
    pu = np.uint64(pa)
    rb = np.uint64(row_bytes)
    nchunks = (R * row_bytes) // 1024
    total = np.uint64(R * row_bytes)
    acc = np.empty(8, dtype=np.uint64)
    acc_a = acc.ctypes.data
    ka = sec.ctypes.data
    k15 = ka + np.uint64(120)
    kl = last.ctypes.data
    for j in range(j0, j1):
        for i in range(8):
            acc[i] = init[i]
        c = 0
        for r in range(R):
            e = eu + np.uint64(eng_blk[j] + eng_row[r])
            p = pu + np.uint64(slot_off[j] + r * row_bytes)
            src, dst = (e, p) if to_slot else (p, e)
            off = np.uint64(0)
            while off < rb:
                c += 1
                if c == nchunks:                  # the input's last stripe: its own key
                    _x3_chunk(acc_a, src + off, dst + off, ka, kl, False)
                else:
                    _x3_chunk(acc_a, src + off, dst + off, ka, k15, True)
                off += np.uint64(1024)
        h = total * np.uint64(0x9E3779B185EBCA87)
        for i in range(4):
            h += _fold(acc[2 * i] ^ merge[2 * i], acc[2 * i + 1] ^ merge[2 * i + 1])
        h ^= h >> np.uint64(37)
        h *= np.uint64(0x165667919E3779F9)
        h ^= h >> np.uint64(32)
        sums[j] = h
    _store_fence()
    return 0
