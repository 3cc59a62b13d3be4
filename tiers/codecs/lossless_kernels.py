"""Compiled (numba) kernels of the lossless payload v2 (lossless.py): the 4-bit top-byte code.

Why numba: the shuffle-and-zstd lossless codec ran at 0.5-0.9 GB/s a core, below the disk it
feeds; these kernels code each element's top byte in one pass at memory speed. `nogil`, so the
daemon's worker threads run several blocks at once; `cache=True` keeps the machine code on
disk, so only the first process compiles. Each kernel returns a status instead of raising: a
malformed payload is DataLoss in the caller, never a crash. Imported on first use
(common.lossless_kernels): importing numba costs a fraction of a second.
"""

from __future__ import annotations

import numba
import numpy as np

_JIT = dict(nogil=True, cache=True, boundscheck=False, error_model="numpy")


@numba.njit(**_JIT)
def ll_encode(block, itemsize, lut, body, low_off, nib_off, esc_off):  # pragma: no cover
    """One pass over the elements (the block's little-endian words, itemsize 2 or 4): the lower
    bytes go to raw planes at low_off (plane p at low_off + p*n), the top byte becomes a 4-bit
    code via `lut` at nib_off (element 2i low nibble, 2i+1 high nibble), where code 15 = escape:
    the byte itself follows in the escape stream at esc_off. Returns the number of escapes.
    Why this shape (2.7 -> 5.7 GB/s a core on bf16): the low planes are separate loops over
    1-D slices (vectorized byte narrowing), and the codes go two elements per nibble byte with
    the escape branch taken only on an escape (rare: the dictionary holds the 15 commonest)."""
    n = block.shape[0] // itemsize
    top = itemsize - 1
    if itemsize == 2:
        w16 = block.view(np.uint16)
        lowp = body[low_off:low_off + n]
        for i in range(n):
            lowp[i] = np.uint8(w16[i] & np.uint16(0xFF))
        return _ll_codes(w16, 8, lut, body[nib_off:nib_off + (n + 1) // 2],
                         body[esc_off:esc_off + n])
    w = block.view(np.uint32)
    for p in range(top):
        plane = body[low_off + p * n:low_off + (p + 1) * n]
        sh = np.uint32(8 * p)
        for i in range(n):
            plane[i] = np.uint8((w[i] >> sh) & np.uint32(0xFF))
    return _ll_codes(w, 8 * top, lut, body[nib_off:nib_off + (n + 1) // 2],
                     body[esc_off:esc_off + n])


@numba.njit(**_JIT)
def _ll_codes(w, sh, lut, nibp, esc):  # pragma: no cover - compiled
    """The 4-bit codes of every word's top byte (w >> sh) into nibp, escapes into esc (one
    compiled variant per word width). Returns the number of escapes."""
    n = w.shape[0]
    ne = 0
    for j in range(n // 2):
        a = np.uint8(w[2 * j] >> sh)
        b = np.uint8(w[2 * j + 1] >> sh)
        ca = lut[a]
        cb = lut[b]
        nibp[j] = ca | (cb << np.uint8(4))
        if ca == 15 or cb == 15:
            if ca == 15:
                esc[ne] = a
                ne += 1
            if cb == 15:
                esc[ne] = b
                ne += 1
    if n & 1:
        a = np.uint8(w[n - 1] >> sh)
        ca = lut[a]
        nibp[n // 2] = ca
        if ca == 15:
            esc[ne] = a
            ne += 1
    return ne


@numba.njit(**_JIT)
def ll_decode(body, itemsize, dic, low_off, nib_off, esc_off, n_esc, out):  # pragma: no cover
    """Inverse of ll_encode into `out` (the block's bytes, 1-D uint8). Returns 0, or 3 when the
    escape stream's length does not match the escape codes (a corrupt payload).
    Why this shape (1.7 -> 7 GB/s a core on bf16): 16-bit elements go two at a time, both top
    bytes from one 256-entry table indexed by the nibble byte, the escape branch only on an
    escape."""
    n = out.shape[0] // itemsize
    top = itemsize - 1
    nibp = body[nib_off:nib_off + (n + 1) // 2]
    esc = body[esc_off:esc_off + n_esc]
    ne = 0
    if itemsize == 2:
        m = n // 2
        t32 = np.empty(256, np.uint32)
        for nb in range(256):
            t32[nb] = (np.uint32(dic[nb & 15]) << np.uint32(8)) | (
                np.uint32(dic[nb >> 4]) << np.uint32(24))
        lowp = body[low_off:low_off + n]
        w16 = out.view(np.uint16)
        w32 = out[:4 * m].view(np.uint32)
        for j in range(m):
            nb = nibp[j]
            v = np.uint32(lowp[2 * j]) | (np.uint32(lowp[2 * j + 1]) << np.uint32(16)) | t32[nb]
            if (nb & np.uint8(15)) == 15 or nb >= np.uint8(0xF0):
                if (nb & np.uint8(15)) == 15:
                    if ne >= n_esc:
                        return 3
                    v = (v & np.uint32(0xFFFF00FF)) | (np.uint32(esc[ne]) << np.uint32(8))
                    ne += 1
                if nb >= np.uint8(0xF0):
                    if ne >= n_esc:
                        return 3
                    v = (v & np.uint32(0x00FFFFFF)) | (np.uint32(esc[ne]) << np.uint32(24))
                    ne += 1
            w32[j] = np.uint32(v)
        if n & 1:
            c = nibp[m] & np.uint8(15)
            tb = dic[c]
            if c == 15:
                if ne >= n_esc:
                    return 3
                tb = esc[ne]
                ne += 1
            w16[n - 1] = np.uint16(lowp[n - 1]) | (np.uint16(tb) << np.uint16(8))
    else:
        w = out.view(np.uint32)
        for i in range(n):
            w[i] = 0
        for p in range(top):
            plane = body[low_off + p * n:low_off + (p + 1) * n]
            sh = np.uint32(8 * p)
            for i in range(n):
                w[i] |= np.uint32(plane[i]) << sh
        sh = np.uint32(8 * top)
        for i in range(n):
            c = nibp[i >> 1]
            c = (c >> np.uint8(4)) if i & 1 else (c & np.uint8(15))
            tb = dic[c]
            if c == 15:
                if ne >= n_esc:
                    return 3
                tb = esc[ne]
                ne += 1
            w[i] |= np.uint32(tb) << sh
    if ne != n_esc:
        return 3
    return 0
