"""Compiled (numba) kernels of the lossy payload v3 (legacy/lossy_v3.py): decode of stored v3
payloads, and the encoder the tests use to make them.

v3 is no longer written (v4, lossy_kernels.py, is). The kernels are written as the v4 ones
are (see lossy_kernels.py for why numba and why each kernel returns a status instead of
raising), and share their scalar helpers and constants. `_exp_tab` / `_exps` are the
table-based exponent search that lossy_kernels._exps replaced; tests/test_codecs_kernels.py
checks the new one against it.
"""

from __future__ import annotations

import numba
import numpy as np

from ..lossy_kernels import BF16, STEPS, TINY, _rint

_JIT = dict(nogil=True, cache=True, boundscheck=False, error_model="numpy")


# ------------------------------------------------------------------ scalar helpers


@numba.njit(**_JIT)
def _bf16_round(x, up):  # pragma: no cover - compiled
    """bf16 bits of float32 x rounded toward +inf (up=True) or -inf (up=False)."""
    a = np.empty(1, np.float32)
    a[0] = x
    u = a.view(np.uint32)[0]
    hi = np.uint32(u >> np.uint32(16))
    if (u & np.uint32(0xFFFF)) != 0:
        neg = (u >> np.uint32(31)) != 0
        if up != neg:                      # away from zero
            hi += np.uint32(1)
    return np.uint16(hi)


@numba.njit(**_JIT)
def _bf16_value(bits):  # pragma: no cover - compiled
    a = np.empty(1, np.uint32)
    a[0] = np.uint32(bits) << np.uint32(16)
    return a.view(np.float32)[0]


@numba.njit(**_JIT)
def _fwht_cols(Y, n, T):  # pragma: no cover - compiled
    """In-place orthonormal Walsh-Hadamard transform of every column of Y[n, T] (n a power of
    two; its own inverse). Rows are channels, columns tokens: each butterfly runs over a
    contiguous row of tokens, so it vectorizes (along a row it did not: 1.9 ns/element).
    Stages go two at a time (radix 4: half the passes over Y, the same additions in the same
    order as one stage at a time, so the same bits), the last one scaling.
    The sizes are taken from Y.shape (as arguments the loops measured 2x slower)."""
    n, T = Y.shape
    s = np.float32(1.0 / np.sqrt(n))
    h = 1
    while 4 * h <= n:
        last = 4 * h == n
        for i in range(0, n, 4 * h):
            for j in range(i, i + h):
                for t in range(T):
                    a = Y[j, t]
                    b = Y[j + h, t]
                    c = Y[j + 2 * h, t]
                    d = Y[j + 3 * h, t]
                    p = a + b
                    q = a - b
                    r = c + d
                    u = c - d
                    if last:
                        Y[j, t] = (p + r) * s
                        Y[j + h, t] = (q + u) * s
                        Y[j + 2 * h, t] = (p - r) * s
                        Y[j + 3 * h, t] = (q - u) * s
                    else:
                        Y[j, t] = p + r
                        Y[j + h, t] = q + u
                        Y[j + 2 * h, t] = p - r
                        Y[j + 3 * h, t] = q - u
        h *= 4
    if h < n:                       # an odd number of stages: one radix-2 stage, scaling
        for j in range(h):
            for t in range(T):
                a = Y[j, t]
                b = Y[j + h, t]
                Y[j, t] = (a + b) * s
                Y[j + h, t] = (a - b) * s
    elif n == 1:
        for t in range(T):
            Y[0, t] *= s


@numba.njit(**_JIT)
def _load_rotated(src16, src32, dt, base, T, HD, D, X, Y, sgn):  # pragma: no cover
    """X[t, :] = Hadamard transform of element vector base + t*HD (through Y[D, T], written
    transposed straight from the source). False when any element is inf/NaN."""
    D, T = Y.shape                  # sizes from shapes: LLVM vectorizes those loops better
    Yu = Y.view(np.uint32)
    m = np.uint32(0)
    for t in range(T):
        o = base + t * HD
        if dt == BF16:
            for d in range(D):
                b = np.uint32(src16[o + d])
                Yu[d, t] = (b << np.uint32(16)) ^ sgn[d]
                m = max(m, b & np.uint32(0x7F80))
        else:
            for d in range(D):
                Y[d, t] = src32[o + d]
                m = max(m, (Yu[d, t] >> np.uint32(16)) & np.uint32(0x7F80))
                Yu[d, t] ^= sgn[d]
    if m == np.uint32(0x7F80):
        return False
    _fwht_cols(Y, D, T)
    for t in range(T):
        for d in range(D):
            X[t, d] = Y[d, t]
    return True


@numba.njit(**_JIT)
def _sqnorm(x, D):  # pragma: no cover - compiled
    """Squared norm with four accumulators (a single one is a 4-cycle dependency chain)."""
    s0 = np.float32(0.0)
    s1 = np.float32(0.0)
    s2 = np.float32(0.0)
    s3 = np.float32(0.0)
    n4 = D - D % 4
    for d in range(0, n4, 4):
        s0 += x[d] * x[d]
        s1 += x[d + 1] * x[d + 1]
        s2 += x[d + 2] * x[d + 2]
        s3 += x[d + 3] * x[d + 3]
    for d in range(n4, D):
        s0 += x[d] * x[d]
    return (s0 + s1) + (s2 + s3)


@numba.njit(**_JIT)
def _codes(x, D, cen, inv, scl, tiny, qmax, fp8, cb, off, yrow):  # pragma: no cover
    """Codes of one vector: (x[d] - cen[d]) * inv[d], clamped, into cb[off:off+D]. With tiny
    (subnormal-range) scales 1/scale overflows float32, so it divides by scl[d] instead."""
    nq = -qmax
    if tiny:
        for d in range(D):
            y = (x[d] - cen[d]) / scl[d]
            y = y if y > nq else nq          # compare-selects: they vectorize
            yrow[d] = y if y < qmax else qmax
    else:
        for d in range(D):
            y = (x[d] - cen[d]) * inv[d]
            y = y if y > nq else nq
            yrow[d] = y if y < qmax else qmax
    if fp8:
        yu = yrow.view(np.uint32)
        for d in range(D):
            b = yu[d]
            u = b & np.uint32(0x7FFFFFFF)
            sign = (b >> np.uint32(24)) & np.uint32(0x80)
            r = u + np.uint32(0x7FFFF) + ((u >> np.uint32(20)) & np.uint32(1))
            cn = (r >> np.uint32(20)) - np.uint32(120 << 3)
            cn = min(cn, np.uint32(0x7E))
            cs = np.uint32(_rint(abs(yrow[d]) * np.float32(512.0)))
            c = cs if u < np.uint32(0x3C800000) else cn
            cb[off + d] = np.uint8(c | sign)
    else:
        for d in range(D):
            cb[off + d] = np.uint8(np.int32(_rint(yrow[d])) & 255)


@numba.njit(**_JIT)
def _exp_of(need, base, thr, cvt):  # pragma: no cover - compiled
    """Largest e in 0..255 with base * 2**(-e/16) >= need (need <= base), from the float bits
    (a libm log2 per token and channel cost ~15% of the encode). thr[j] = 2**(j/16)."""
    if need <= 0:
        return 255
    cvt[0] = need / base
    u = cvt.view(np.uint32)[0]
    k = np.int32(u >> np.uint32(23)) - 127          # r = m * 2**k, m in [1, 2)
    cvt.view(np.uint32)[0] = (u & np.uint32(0x7FFFFF)) | np.uint32(0x3F800000)
    m = cvt[0]
    c = 0
    while c < STEPS and thr[c] < m:
        c += 1
    e = -STEPS * k - c
    return min(max(e, 0), 255)


@numba.njit(**_JIT)
def q3_encode(src16, src32, dt, L, T, H, D, fp8, rot_k, rot_v, sink_ratio, exp_lut, sgn, idx12,
              slab, kidx, kexp, vexp, codes, sinks):  # pragma: no cover - compiled
    """Quantize one canonical block [L,2,T,H,D] (elements in src16 (bf16 bits) or src32).

    Per (layer, head): vectors optionally Hadamard-rotated over D; keys then get per channel a
    centre o (on a grid of 255 steps between the slab's smallest and largest centre) and a
    scale (kexp: 2**(-e/16) below the slab's largest); values one scale per token (vexp).
    slab[l,h] = bf16 bits of (centre min, centre step, key scale base, value scale base).
    The key of the (layer, head)'s sink token (squared value norm < sink_ratio**2 x the median)
    is left out of the key statistics and flagged in sinks[l,t,h] (the caller stores it
    exactly). Returns 0, or 1 when the block holds inf/NaN.
    """
    qmax = np.float32(448.0) if fp8 else np.float32(127.0)
    X = np.empty((T, D), np.float32)
    Y = np.empty((D, T), np.float32)
    Xu = X.view(np.uint32)
    hi = np.empty(D, np.float32)
    lo = np.empty(D, np.float32)
    cen = np.empty(D, np.float32)
    need = np.empty(D, np.float32)
    inv = np.empty(D, np.float32)
    scl = np.empty(D, np.float32)
    zero = np.zeros(D, np.float32)
    yrow = np.empty(D, np.float32)
    vn = np.empty(T, np.float32)
    srt = np.empty(T, np.float32)
    sv = np.empty(T, np.float32)
    cvt = np.empty(1, np.uint32)
    fcvt = np.empty(1, np.float32)
    thr = np.empty(STEPS + 1, np.float32)
    for j in range(STEPS + 1):
        thr[j] = np.float32(2.0 ** (j / STEPS))
    HD = H * D
    for ly in range(L):
        for h in range(H):
            # ---- values: norms (for the sink rule), rotation, one scale per token
            for t in range(T):
                sinks[ly, t, h] = False
            vbase = ((ly * 2 + 1) * T * H + h) * D
            if rot_v:
                if not _load_rotated(src16, src32, dt, vbase, T, HD, D, X, Y, sgn):
                    return 1
            elif not _load_rows(src16, src32, dt, vbase, HD, X):
                return 1
            vmax = np.float32(0.0)
            for t in range(T):
                vn[t] = _sqnorm(X[t], D)       # the rotation keeps norms
            for t in range(T):
                m = np.uint32(0)
                for d in range(D):               # max |x| on the bits: vectorizes
                    m = max(m, Xu[t, d] & np.uint32(0x7FFFFFFF))
                cvt[0] = m
                sv[t] = cvt.view(np.float32)[0] / qmax
                vmax = max(vmax, sv[t])
            sink = -1
            if T > 1:
                srt[:] = vn
                srt.sort()
                med = srt[(T - 1) // 2] if T % 2 == 1 else np.float32(0.5) * (
                    srt[T // 2 - 1] + srt[T // 2])
                tmin = 0
                for t in range(1, T):
                    if vn[t] < vn[tmin]:
                        tmin = t
                if vn[tmin] < np.float32(sink_ratio * sink_ratio) * med:
                    sink = tmin
            vb_bits = _bf16_round(vmax, True) if vmax > 0 else np.uint16(0x3F80)
            vb = _bf16_value(vb_bits)
            for t in range(T):
                e = _exp_of(sv[t], vb, thr, fcvt)
                vexp[ly, t, h] = e
                sc = vb * exp_lut[e]
                s = np.float32(1.0) / sc
                for d in range(D):
                    inv[d] = s
                    scl[d] = sc
                _codes(X[t], D, zero, inv, scl, vb < TINY, qmax, fp8, codes, vbase + t * HD,
                       yrow)
            # ---- keys: one centre and one scale per channel
            kbase = ((ly * 2) * T * H + h) * D
            if rot_k:
                if not _load_rotated(src16, src32, dt, kbase, T, HD, D, X, Y, sgn):
                    return 1
            elif not _load_rows(src16, src32, dt, kbase, HD, X):
                return 1
            for d in range(D):
                hi[d] = -np.inf
                lo[d] = np.inf
            for t in range(T):
                if t != sink or T == 1:    # the sink stays out of the statistics
                    for d in range(D):
                        hi[d] = max(hi[d], X[t, d])
                        lo[d] = min(lo[d], X[t, d])
            cmin = np.float32(np.inf)
            cmax = np.float32(-np.inf)
            for d in range(D):
                cen[d] = np.float32(0.5) * hi[d] + np.float32(0.5) * lo[d]
                cmin = min(cmin, cen[d])
                cmax = max(cmax, cen[d])
            cmin_bits = _bf16_round(cmin, False)
            c0 = _bf16_value(cmin_bits)
            top = 4095 if idx12 else 255
            step = (cmax - c0) / np.float32(top) * np.float32(1.01)
            step_bits = _bf16_round(step, True) if step > 0 else np.uint16(0)
            st = _bf16_value(step_bits)
            kmax = np.float32(0.0)
            for d in range(D):
                ix = 0
                if st > 0:
                    ix = int(_rint((cen[d] - c0) / st))
                    ix = min(max(ix, 0), top)
                if not idx12:
                    kidx[ly, h, d] = ix
                else:   # two channels in three bytes: both low bytes, then the high nibbles
                    g = (d >> 1) * 3
                    kidx[ly, h, g + (d & 1)] = ix & 255
                    if d & 1:
                        kidx[ly, h, g + 2] |= np.uint8((ix >> 8) << 4)
                    else:
                        kidx[ly, h, g + 2] = np.uint8(ix >> 8)
                o = c0 + np.float32(ix) * st
                cen[d] = o
                need[d] = max(hi[d] - o, o - lo[d]) / qmax
                kmax = max(kmax, need[d])
            kb_bits = _bf16_round(kmax, True) if kmax > 0 else np.uint16(0x3F80)
            kb = _bf16_value(kb_bits)
            slab[ly, h, 0] = cmin_bits
            slab[ly, h, 1] = step_bits
            slab[ly, h, 2] = kb_bits
            slab[ly, h, 3] = vb_bits
            slab[ly, h, 4] = 0x3F80          # 1.0: no sink in this (layer, head)
            if sink >= 0:   # the sink key gets a scale of its own (centre 0)
                m = np.float32(0.0)
                for d in range(D):
                    m = max(m, abs(X[sink, d]))
                sb_bits = _bf16_round(m / np.float32(127.0), True) if m > 0 else np.uint16(
                    0x3F80)
                slab[ly, h, 4] = sb_bits
                ssc = _bf16_value(sb_bits)
                for d in range(D):
                    zero[d] = np.float32(0.0)
                    scl[d] = ssc
                    inv[d] = np.float32(1.0) / ssc
                sinks[ly, sink, h] = True
                # int8 codes in both codecs: FP8's 3-bit mantissa on the key most queries
                # attend to moved whole heads (fp8 worst head 0.114 -> see docs/codecs.md)
                _codes(X[sink], D, zero, inv, scl, ssc < TINY, np.float32(127.0), False,
                       codes, kbase + sink * HD, yrow)
            for d in range(D):
                e = _exp_of(need[d], kb, thr, fcvt)
                kexp[ly, h, d] = e
                scl[d] = kb * exp_lut[e]
                inv[d] = np.float32(1.0) / scl[d]
            for t in range(T):
                if t != sink:
                    _codes(X[t], D, cen, inv, scl, kb < TINY, qmax, fp8, codes,
                           kbase + t * HD, yrow)
    return 0


@numba.njit(**_JIT)
def q3_decode(dst16, dst32, dt, L, T, H, D, fp8, rot_k, rot_v, exp_lut, f8_lut, sgn, idx12,
              slab, kidx, kexp, vexp, codes, sinks):  # pragma: no cover - compiled
    """Inverse of q3_encode (exact keys are written by the caller afterwards).
    Returns 0, or 2 when the side info is not finite/positive (a corrupt payload)."""
    X = np.empty((T, D), np.float32)
    Y = np.empty((D, T), np.float32)
    Xu = X.view(np.uint32)
    sc = np.empty(D, np.float32)
    cen = np.empty(D, np.float32)
    lut = np.empty(256, np.float32)
    for c in range(256):
        lut[c] = f8_lut[c] if fp8 else np.float32(np.int8(np.uint8(c)))
    HD = H * D
    for ly in range(L):
        for h in range(H):
            c0 = _bf16_value(slab[ly, h, 0])
            st = _bf16_value(slab[ly, h, 1])
            kb = _bf16_value(slab[ly, h, 2])
            vb = _bf16_value(slab[ly, h, 3])
            sb = _bf16_value(slab[ly, h, 4])
            if not (np.isfinite(c0) and np.isfinite(st) and st >= 0 and np.isfinite(kb)
                    and kb > 0 and np.isfinite(vb) and vb > 0 and np.isfinite(sb) and sb > 0):
                return 2
            for d in range(D):
                if idx12:
                    g = (d >> 1) * 3
                    ix = np.int32(kidx[ly, h, g + (d & 1)]) | (
                        (np.int32(kidx[ly, h, g + 2]) >> (4 * (d & 1)) & 15) << 8)
                else:
                    ix = np.int32(kidx[ly, h, d])
                cen[d] = c0 + np.float32(ix) * st
                sc[d] = kb * exp_lut[kexp[ly, h, d]]
            for part in range(2):
                rotate = rot_v if part else rot_k
                base = ((ly * 2 + part) * T * H + h) * D
                Z = Y if rotate else X.T       # [D, T]: rotated through Y, else X
                for t in range(T):
                    off = base + t * HD
                    if part == 0 and sinks[ly, t, h]:         # int8 codes in both codecs
                        for d in range(D):
                            Z[d, t] = np.float32(np.int8(codes[off + d])) * sb
                    elif part == 0:
                        for d in range(D):
                            Z[d, t] = cen[d] + lut[codes[off + d]] * sc[d]
                    else:
                        s = vb * exp_lut[vexp[ly, t, h]]
                        for d in range(D):
                            Z[d, t] = lut[codes[off + d]] * s
                if rotate:
                    _fwht_cols(Y, D, T)
                    Yu = Y.view(np.uint32)
                    for t in range(T):
                        for d in range(D):
                            Xu[t, d] = Yu[d, t] ^ sgn[d]
                for t in range(T):
                    off = base + t * HD
                    if dt == BF16:
                        for d in range(D):
                            u = Xu[t, d]
                            dst16[off + d] = np.uint16((u + np.uint32(0x7FFF) + (
                                (u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
                    else:
                        for d in range(D):
                            dst32[off + d] = X[t, d]
    return 0


@numba.njit(**_JIT)
def _load_rows(src16, src32, dt, base, HD, X):  # pragma: no cover - compiled
    """X[t, d] = element base + t*HD + d as float32; False when any is inf/NaN."""
    T, D = X.shape
    Xu = X.view(np.uint32)
    m = np.uint32(0)
    for t in range(T):
        o = base + t * HD
        if dt == BF16:
            for d in range(D):
                b = np.uint32(src16[o + d])
                Xu[t, d] = b << np.uint32(16)
                m = max(m, b & np.uint32(0x7F80))
        else:
            for d in range(D):
                X[t, d] = src32[o + d]
            for d in range(D):
                m = max(m, (Xu[t, d] >> np.uint32(16)) & np.uint32(0x7F80))
    return m != np.uint32(0x7F80)


@numba.njit(**_JIT)
def _exp_tab():  # pragma: no cover - compiled
    """tab[i] = number of thresholds 2**(j/STEPS), j < STEPS, below 1 + i/1024: a lower bound
    of the step count for any mantissa with top bits i (the thresholds are 2.2% apart, more
    than 1/1024, so one more comparison finishes it)."""
    tab = np.empty(1024, np.int32)
    for i in range(1024):
        m = 1.0 + i / 1024.0
        c = 0
        while c < STEPS and 2.0 ** (c / STEPS) < m:
            c += 1
        tab[i] = max(c - 1, 0)
    return tab


@numba.njit(**_JIT)
def _exps(need, base, R, thr, tab, e_out):  # pragma: no cover - compiled
    """e_out[i] = largest e in 0..255 with base * 2**(-e/STEPS) >= need[i] (need <= base),
    from the float bits of need/base: exponent, then a table on the top mantissa bits and one
    comparison (R: float32 scratch of need's size)."""
    n = need.shape[0]
    for i in range(n):
        R[i] = need[i] / base
    Ru = R.view(np.uint32)
    for i in range(n):
        u = Ru[i]
        if need[i] <= 0 or u == 0:
            e_out[i] = 255
            continue
        k = np.int32(u >> np.uint32(23)) - 127
        mb = u & np.uint32(0x7FFFFF)
        Ru[i] = mb | np.uint32(0x3F800000)
        m = R[i]
        c = tab[mb >> np.uint32(13)]
        if thr[c] < m:
            c += 1
        if c < STEPS and thr[c] < m:
            c += 1
        e = -STEPS * k - c
        e_out[i] = min(max(e, 0), 255)
