"""Compiled (numba) kernels of the v3/v4 lossy codecs and the v2 lossless codec.

Why numba: the torch/zstd codecs ran 8+ whole-block passes (0.1-0.5 GB/s on this class of CPU,
below the SSD's write speed, issue 14). Here each (layer, head) slab of a block is read once,
transformed and quantized while it sits in L1, and written once. Kernels are `nogil`, so the
daemon's worker threads encode several blocks at once; they are not numba-parallel (nested
thread pools under the daemon's own workers oversubscribed the cores, docs/codecs.md).
`cache=True` keeps the machine code on disk: only the first process compiles (a few seconds).

Imported lazily by codec_q3 / codec_q4 / codec_lossless (importing numba costs a fraction of a
second). Every kernel returns a status (0 = ok) instead of raising, so a malformed payload is
DataLoss in the caller, never a crash.
"""

from __future__ import annotations

import numba
import numpy as np

_JIT = dict(nogil=True, cache=True, boundscheck=False, error_model="numpy")

# Scales below this make 1/scale overflow float32 (max 3.4e38 = 2**128): divide instead.
TINY = np.float32(2.0 ** -100)

# Scale exponents: scale = base * 2**(-e/STEPS), e in 0..255 (the v3 payload format).
STEPS = 32

# Dtype codes of the block's elements.
BF16, F16, F32 = 0, 1, 2


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
def _rotate(X, Y, D, T):  # pragma: no cover - compiled
    """X[T, D] <- its rows Hadamard-transformed (through the transposed scratch Y[D, T])."""
    for t in range(T):
        for d in range(D):
            Y[d, t] = X[t, d]
    _fwht_cols(Y, D, T)
    for t in range(T):
        for d in range(D):
            X[t, d] = Y[d, t]


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
def _rint(y):  # pragma: no cover - compiled
    """Round half to even for |y| < 2**22 (np.rint is an out-of-line call here, 3x slower):
    adding and subtracting 1.5 * 2**23 leaves the float32 rounded to an integer."""
    m = np.float32(12582912.0)
    return (y + m) - m


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


# ------------------------------------------------------------------ lossless v2


@numba.njit(**_JIT)
def ll_encode(words, itemsize, lut, body, low_off, nib_off, esc_off):  # pragma: no cover
    """One pass over the elements (little-endian words as uint8 rows [n, itemsize]): the lower
    bytes go to raw planes at low_off (plane p at low_off + p*n), the top byte becomes a 4-bit
    code via `lut` at nib_off (element 2i low nibble, 2i+1 high nibble), where code 15 = escape:
    the byte itself follows in the escape stream at esc_off. Returns the number of escapes."""
    n = words.shape[0]
    top = itemsize - 1
    ne = 0
    if itemsize == 2:
        for i in range(n):
            body[low_off + i] = words[i, 0]
    else:
        for i in range(n):
            for p in range(top):
                body[low_off + p * n + i] = words[i, p]
    for i in range(n):
        b = words[i, top]
        c = np.uint8(lut[b])
        if i & 1:
            body[nib_off + (i >> 1)] |= np.uint8(c << 4)
        else:
            body[nib_off + (i >> 1)] = np.uint8(c)
        if c == 15:
            body[esc_off + ne] = b
            ne += 1
    return ne


@numba.njit(**_JIT)
def ll_decode(body, itemsize, dic, low_off, nib_off, esc_off, n_esc, words):  # pragma: no cover
    """Inverse of ll_encode. Returns 0, or 3 when the escape stream's length does not match
    the escape codes (a corrupt payload)."""
    n = words.shape[0]
    top = itemsize - 1
    ne = 0
    if itemsize == 2:
        for i in range(n):
            words[i, 0] = body[low_off + i]
    else:
        for i in range(n):
            for p in range(top):
                words[i, p] = body[low_off + p * n + i]
    for i in range(n):
        c = np.int64(body[nib_off + (i >> 1)])
        if i & 1:
            c = c >> 4
        else:
            c = c & 15
        if c == 15:
            if ne >= n_esc:
                return 3
            words[i, top] = body[esc_off + ne]
            ne += 1
        else:
            words[i, top] = dic[c]
    if ne != n_esc:
        return 3
    return 0


# ------------------------------------------------------------------ lossy v4


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
def _transpose(X, Y):  # pragma: no cover - compiled
    """Y[d, t] = X[t, d] (contiguous stores, strided loads: measured faster than the reverse)."""
    T, D = X.shape
    for d in range(D):
        for t in range(T):
            Y[d, t] = X[t, d]


@numba.njit(**_JIT)
def _load_cm(src16, src32, dt, base, HD, X, Y):  # pragma: no cover - compiled
    """Y[d, t] = element base + t*HD + d as float32 (channel-major, as the transform and the
    v4 code order want it), through the row scratch X[T, D]. False when any is inf/NaN."""
    if not _load_rows(src16, src32, dt, base, HD, X):
        return False
    _transpose(X, Y)
    return True


@numba.njit(**_JIT)
def _median_sorted(srt):  # pragma: no cover - compiled
    n = srt.shape[0]
    srt.sort()
    if n % 2 == 1:
        return srt[(n - 1) // 2]
    return np.float32(0.5) * (srt[n // 2 - 1] + srt[n // 2])


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
def _col_norm_absmax(Y, Yu, vn, am):  # pragma: no cover - compiled
    """vn[t] = squared norm of column t, am[t] = bits of its max |Y[d, t]| (on the float bits:
    an integer max vectorizes), in one pass. Each of these small helpers takes its sizes from
    the arrays' shapes: inlined into the big kernel with loop bounds from arguments, the same
    loops ran 3-5x slower (not vectorized)."""
    D, T = Y.shape
    for t in range(T):
        vn[t] = 0
        am[t] = 0
    for d in range(D):
        for t in range(T):
            vn[t] += Y[d, t] * Y[d, t]
            am[t] = max(am[t], Yu[d, t] & np.uint32(0x7FFFFFFF))


@numba.njit(**_JIT)
def _col_dev(Y, mu, dev):  # pragma: no cover - compiled
    """dev[t] = squared distance of column t from the mean column (mu: scratch[D])."""
    D, T = Y.shape
    for d in range(D):
        sm = np.float32(0.0)
        for t in range(T):
            sm += Y[d, t]
        mu[d] = sm / np.float32(T)
    for t in range(T):
        dev[t] = 0
    for d in range(D):
        m = mu[d]
        for t in range(T):
            z = Y[d, t] - m
            dev[t] += z * z


@numba.njit(**_JIT)
def _row_hilo(Y, ninf, hi, nlo):  # pragma: no cover - compiled
    """hi[d] = max_t Y[d, t] and nlo[d] = max_t -Y[d, t] over the tokens with ninf[t] == 0
    (exact tokens carry -inf there and drop out of both maxima)."""
    D, T = Y.shape
    for d in range(D):
        a = np.float32(-np.inf)
        b = np.float32(-np.inf)
        for t in range(T):
            a = max(a, Y[d, t] + ninf[t])
            b = max(b, ninf[t] - Y[d, t])
        hi[d] = a
        nlo[d] = b


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


@numba.njit(**_JIT)
def _quant_tile(Y, cen, rinv, cinv, rsc, csc, tiny, qmax, fp8, Z, codes, cbase):  # pragma: no cover
    """Codes of a channel-major tile Y[D, T] into codes[cbase : cbase + D*T]:
    z = (Y[d, t] - cen[d]) * rinv[d] * cinv[t] (row and column scales; keys use rows, values
    columns), clamped to +-qmax, rounded to int8 or e4m3fn. With tiny scales (1/scale would
    overflow float32) it divides by rsc[d] * csc[t] instead."""
    D, T = Y.shape
    nq = -qmax
    if not fp8 and not tiny:       # one pass: scale, clamp, round, store (the common case)
        for d in range(D):
            c = cen[d]
            a = rinv[d]
            off = cbase + d * T
            for t in range(T):
                z = (Y[d, t] - c) * a * cinv[t]
                z = z if z > nq else nq        # compare-selects: they vectorize
                z = z if z < qmax else qmax
                codes[off + t] = np.uint8(np.int32(_rint(z)) & 255)
        return
    for d in range(D):
        c = cen[d]
        a = rinv[d]
        for t in range(T):
            if tiny:
                z = (Y[d, t] - c) / (rsc[d] * csc[t])
            else:
                z = (Y[d, t] - c) * a * cinv[t]
            z = z if z > nq else nq
            Z[d, t] = z if z < qmax else qmax
    Zu = Z.view(np.uint32)
    if fp8:
        for d in range(D):
            off = cbase + d * T
            for t in range(T):
                b = Zu[d, t]
                u = b & np.uint32(0x7FFFFFFF)
                sign = (b >> np.uint32(24)) & np.uint32(0x80)
                r = u + np.uint32(0x7FFFF) + ((u >> np.uint32(20)) & np.uint32(1))
                cn = (r >> np.uint32(20)) - np.uint32(120 << 3)
                cn = min(cn, np.uint32(0x7E))
                cs = np.uint32(_rint(abs(Z[d, t]) * np.float32(512.0)))
                cc = cs if u < np.uint32(0x3C800000) else cn
                codes[off + t] = np.uint8(cc | sign)
    else:
        for d in range(D):
            off = cbase + d * T
            for t in range(T):
                codes[off + t] = np.uint8(np.int32(_rint(Z[d, t])) & 255)


@numba.njit(**_JIT)
def q4_encode(src16, src32, dt, L, T, H, D, fp8, rot_k, rot_v, sink_ratio, vsink_ratio, kout_ratio,
              exp_lut, slab, kidx, kexp, vexp, codes, xk, xv):  # pragma: no cover - compiled
    """Quantize one canonical block [L,2,T,H,D] into the v4 sections (tiers/codec_q4.py).

    Per (layer, head), channel-major (Y[d, t]): keys and values optionally Hadamard-rotated
    (rot_k, rot_v); values
    one scale per token; keys per channel a centre (8-bit index on a grid between the slab's
    smallest and largest centre) and a scale. Tokens kept exact (flagged in xk / xv, their raw
    bytes stored by the caller) stay out of the statistics: the value sink (squared value norm
    < sink_ratio**2 x the median) has its key and value exact; the key farthest from the
    channel means, when its distance is > kout_ratio x the median distance, has its key exact.
    Returns 0, or 1 when the block holds inf/NaN."""
    qmax = np.float32(448.0) if fp8 else np.float32(127.0)
    Y = np.empty((D, T), np.float32)
    Z = np.empty((D, T), np.float32)
    X = np.empty((T, D), np.float32)
    Yu = Y.view(np.uint32)
    hi = np.empty(D, np.float32)
    lo = np.empty(D, np.float32)
    cen = np.empty(D, np.float32)
    need = np.empty(D, np.float32)
    dinv = np.empty(D, np.float32)
    dsc = np.empty(D, np.float32)
    zero_d = np.zeros(D, np.float32)
    one_d = np.ones(D, np.float32)
    one_t = np.ones(T, np.float32)
    am = np.empty(T, np.uint32)
    vn = np.empty(T, np.float32)
    dev = np.empty(T, np.float32)
    srt = np.empty(T, np.float32)
    tinv = np.empty(T, np.float32)
    tsc = np.empty(T, np.float32)
    ninf = np.empty(T, np.float32)          # -inf for exact tokens (left out of max), else 0
    fcvt = np.empty(1, np.float32)
    thr = np.empty(STEPS + 1, np.float32)
    for j in range(STEPS + 1):
        thr[j] = np.float32(2.0 ** (j / STEPS))
    tab = _exp_tab()
    rt = np.empty(T, np.float32)
    rd = np.empty(D, np.float32)
    et = np.empty(T, np.int32)
    ed = np.empty(D, np.int32)
    HD = H * D
    DT = D * T
    for ly in range(L):
        for h in range(H):
            for t in range(T):
                xk[ly, t, h] = False
                xv[ly, t, h] = False
            # ---- values: norms (sink rule), rotation, one scale per token
            if not _load_cm(src16, src32, dt, ((ly * 2 + 1) * T * H + h) * D, HD, X, Y):
                return 1
            if rot_v:                # the rotation keeps the norms the sink rule reads
                _fwht_cols(Y, D, T)
            _col_norm_absmax(Y, Yu, vn, am)
            sink = -1
            if T > 1:
                srt[:] = vn
                med = _median_sorted(srt)
                tmin = 0
                for t in range(1, T):
                    if vn[t] < vn[tmin]:
                        tmin = t
                if vn[tmin] < np.float32(sink_ratio * sink_ratio) * med:
                    sink = tmin
                    xk[ly, sink, h] = True
                    xv[ly, sink, h] = vn[tmin] < np.float32(vsink_ratio * vsink_ratio) * med
            vmax = np.float32(0.0)
            for t in range(T):
                fcvt.view(np.uint32)[0] = am[t]
                tsc[t] = fcvt[0] / qmax
                if t != sink or not xv[ly, t, h]:
                    vmax = max(vmax, tsc[t])
            vb_bits = _bf16_round(vmax, True) if vmax > 0 else np.uint16(0x3F80)
            vb = _bf16_value(vb_bits)
            for t in range(T):
                tsc[t] = min(tsc[t], vb)
            _exps(tsc, vb, rt, thr, tab, et)
            for t in range(T):
                vexp[ly, t, h] = et[t]
                tsc[t] = vb * exp_lut[et[t]]
                tinv[t] = np.float32(1.0) / tsc[t]
            _quant_tile(Y, zero_d, one_d, tinv, one_d, tsc, vb < TINY, qmax, fp8, Z, codes,
                        ((ly * 2 + 1) * H + h) * DT)
            # ---- keys: the outlier key, then one centre and one scale per channel
            if not _load_cm(src16, src32, dt, ((ly * 2) * T * H + h) * D, HD, X, Y):
                return 1
            if rot_k:
                _fwht_cols(Y, D, T)
            _col_dev(Y, dsc, dev)
            ninf[:] = 0
            if sink >= 0:
                ninf[sink] = -np.inf
            if T > 2:
                srt[:] = dev
                dmed = _median_sorted(srt)
                tout = -1
                for t in range(T):
                    if t != sink and (tout < 0 or dev[t] > dev[tout]):
                        tout = t
                if dev[tout] > np.float32(kout_ratio * kout_ratio) * dmed:
                    xk[ly, tout, h] = True
                    ninf[tout] = -np.inf
            cmin = np.float32(np.inf)
            cmax = np.float32(-np.inf)
            _row_hilo(Y, ninf, hi, lo)
            for d in range(D):
                a = hi[d]
                b = lo[d]
                if a == -np.inf:                 # every token exact (T <= 2)
                    a = np.float32(0.0)
                    b = np.float32(0.0)
                hi[d] = a
                lo[d] = -b
                cen[d] = np.float32(0.5) * a - np.float32(0.5) * b
                cmin = min(cmin, cen[d])
                cmax = max(cmax, cen[d])
            cmin_bits = _bf16_round(cmin, False)
            c0 = _bf16_value(cmin_bits)
            step = (cmax - c0) / np.float32(255.0) * np.float32(1.01)
            step_bits = _bf16_round(step, True) if step > 0 else np.uint16(0)
            st = _bf16_value(step_bits)
            kmax = np.float32(0.0)
            for d in range(D):
                ix = 0
                if st > 0:
                    ix = int(_rint((cen[d] - c0) / st))
                    ix = min(max(ix, 0), 255)
                kidx[ly, h, d] = ix
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
            _exps(need, kb, rd, thr, tab, ed)
            for d in range(D):
                kexp[ly, h, d] = ed[d]
                dsc[d] = kb * exp_lut[ed[d]]
                dinv[d] = np.float32(1.0) / dsc[d]
            _quant_tile(Y, cen, dinv, one_t, dsc, one_t, kb < TINY, qmax, fp8, Z, codes,
                        ((ly * 2) * H + h) * DT)
    return 0


@numba.njit(**_JIT)
def _transpose_back(Y, X):  # pragma: no cover - compiled
    """X[t, d] = Y[d, t] (contiguous stores)."""
    D, T = Y.shape
    for t in range(T):
        for d in range(D):
            X[t, d] = Y[d, t]


@numba.njit(**_JIT)
def _dequant_tile(codes, cbase, cen, rsc, csc, lut, fp8, Y):  # pragma: no cover - compiled
    """Y[d, t] = cen[d] + value(codes[cbase + d*T + t]) * rsc[d] * csc[t]; int8 codes convert
    directly (vectorizes), e4m3fn codes through the 256-entry table."""
    D, T = Y.shape
    for d in range(D):
        off = cbase + d * T
        c = cen[d]
        a = rsc[d]
        if fp8:
            for t in range(T):
                Y[d, t] = c + lut[codes[off + t]] * (a * csc[t])
        else:
            for t in range(T):
                Y[d, t] = c + np.float32(np.int8(codes[off + t])) * (a * csc[t])


@numba.njit(**_JIT)
def _store_rows(X, dt, base, HD, dst16, dst32):  # pragma: no cover - compiled
    """Element base + t*HD + d = X[t, d], rounded to bf16 (nearest even) or as float32."""
    T, D = X.shape
    Xu = X.view(np.uint32)
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


@numba.njit(**_JIT)
def q4_decode(dst16, dst32, dt, L, T, H, D, fp8, rot_k, rot_v, exp_lut, f8_lut, slab, kidx,
              kexp, vexp, codes):  # pragma: no cover - compiled
    """Inverse of q4_encode (exact tokens are written by the caller afterwards).
    Returns 0, or 2 when the side info is not finite/positive (a corrupt payload)."""
    Y = np.empty((D, T), np.float32)
    X = np.empty((T, D), np.float32)
    cen = np.empty(D, np.float32)
    dsc = np.empty(D, np.float32)
    tsc = np.empty(T, np.float32)
    zero_d = np.zeros(D, np.float32)
    one_d = np.ones(D, np.float32)
    one_t = np.ones(T, np.float32)
    lut = np.empty(256, np.float32)
    for c in range(256):
        lut[c] = f8_lut[c] if fp8 else np.float32(np.int8(np.uint8(c)))
    HD = H * D
    DT = D * T
    for ly in range(L):
        for h in range(H):
            c0 = _bf16_value(slab[ly, h, 0])
            st = _bf16_value(slab[ly, h, 1])
            kb = _bf16_value(slab[ly, h, 2])
            vb = _bf16_value(slab[ly, h, 3])
            if not (np.isfinite(c0) and np.isfinite(st) and st >= 0 and np.isfinite(kb)
                    and kb > 0 and np.isfinite(vb) and vb > 0):
                return 2
            for d in range(D):
                cen[d] = c0 + np.float32(kidx[ly, h, d]) * st
                dsc[d] = kb * exp_lut[kexp[ly, h, d]]
            for t in range(T):
                tsc[t] = vb * exp_lut[vexp[ly, t, h]]
            for part in range(2):
                cbase = ((ly * 2 + part) * H + h) * DT
                if part == 0:
                    _dequant_tile(codes, cbase, cen, dsc, one_t, lut, fp8, Y)
                else:
                    _dequant_tile(codes, cbase, zero_d, one_d, tsc, lut, fp8, Y)
                if rot_v if part else rot_k:
                    _fwht_cols(Y, D, T)
                _transpose_back(Y, X)
                _store_rows(X, dt, ((ly * 2 + part) * T * H + h) * D, HD, dst16, dst32)
    return 0
