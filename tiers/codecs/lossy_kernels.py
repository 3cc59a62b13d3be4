"""Compiled (numba) kernels of the lossy payload v4 (lossy.py), encode and decode.

Why numba: torch and zstd ran the lossy codecs in 8+ whole-block passes at 0.1-0.5 GB/s, below
the disk they feed; here each (layer, head) slab of a block is read once, transformed and
quantized while it sits in L1, and written once. Kernels are `nogil`, so the daemon's worker
threads encode several blocks at once; they are not numba-parallel (nested thread pools under
the daemon's own workers oversubscribed the cores, docs/codecs.md). `cache=True` keeps the
machine code on disk: only the first process compiles (a few seconds).

Why written this way (the goal: each codec at disk speed or better on the daemon's worker
threads; measured per 2 MiB bf16 block on one core): the first v4
kernels ran ~0.9 GB/s encode, ~1.7 decode, and a profile of them put 0.4-0.6 ns per element into
each of load, statistics and quantization, against ~0.03-0.13 for the same loops written so that
LLVM vectorizes them. What made the difference, and holds for every loop here:
- the inner loop runs over a 1-D row *slice* (`row = a[o:o + n]`, then `row[i]`): an index
  computed as `off + i` may be negative as far as numba knows, so each access carried a
  wrap-around select and the loop stayed scalar (quantizing 0.47 -> 0.13 ns per element);
- float bits are reinterpreted in registers (`_f2u` / `_u2f`, an LLVM bitcast) instead of
  through a scratch array and a second loop (FP8 code conversion, bf16 rounding);
- maxima and minima are taken on integer keys (floats compare as integers after `_key`): a
  float max reduction does not vectorize without fast-math, an integer one does;
- the per-channel key sum uses a fast-math (reassociating) reduction, the only float result here
  that depends on summation order; it only ranks tokens for the outlier rule.
The tile is still worked channel-major (Y[D, T]): the Hadamard transform then runs along
contiguous rows of tokens and the codes leave in the payload's order; the one transpose is on
the way in (encode) or out (decode), L1 to L1.
Every other result (codes, scales, centres, decoded values) is the same, bit for bit, as the
first v4 kernels produced: tests/test_codecs_v4.py pins decode of stored payloads.

Every kernel returns a status (0 = ok) instead of raising, so a malformed payload is DataLoss in
the caller, never a crash. Imported on first use (common.lossy_kernels). The scalar helpers
and constants below are shared with the legacy v3 kernels (legacy/lossy_v3_kernels.py).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_JIT = dict(nogil=True, cache=True, boundscheck=False, error_model="numpy")
_JIT_SUM = dict(_JIT, fastmath={"reassoc"})

# Scales below this make 1/scale overflow float32 (max 3.4e38 = 2**128): divide instead.
TINY = np.float32(2.0 ** -100)

# Scale exponents: scale = base * 2**(-e/STEPS), e in 0..255 (the v3 and v4 payload formats).
STEPS = 32

# Dtype codes of the block's elements.
BF16, F16, F32 = 0, 1, 2

# The largest magnitude a lossy block may hold: below 2**MAX_EXP. The rotation's partial sums
# grow to D times an element, and the outlier rule's statistics further, in float32 (max
# 2**128): finite values from about 5e36 (2**122, D = 128) overflowed there, encoding to a
# payload that never decodes, or decoding an outlier to inf and NaN. 2**100 leaves 2**22 of
# headroom and is far past real KV (fp16 itself stops at 65504), so such a block is refused like
# inf/NaN (NonFiniteBlock: stored lossless). The loads test it for free: adding (256 - biased
# bound) to the exponent field carries into the sign bit exactly for exponents at or past the
# bound (all ones, inf/NaN, included).
MAX_EXP = 100
_CARRY16 = (256 - (127 + MAX_EXP)) << 7          # bf16: exponent in bits 7..14
_CARRY32 = (256 - (127 + MAX_EXP)) << 23         # float32: exponent in bits 23..30


@numba.njit(**_JIT)
def _rint(y):  # pragma: no cover - compiled
    """Round half to even for |y| < 2**22 (np.rint is an out-of-line call here, 3x slower):
    adding and subtracting 1.5 * 2**23 leaves the float32 rounded to an integer."""
    m = np.float32(12582912.0)
    return (y + m) - m


@numba.njit(**_JIT)
def _median_sorted(srt):  # pragma: no cover - compiled
    n = srt.shape[0]
    srt.sort()
    if n % 2 == 1:
        return srt[(n - 1) // 2]
    return np.float32(0.5) * (srt[n // 2 - 1] + srt[n // 2])


_I32_MIN = -(1 << 31)
_I32_MAX = (1 << 31) - 1


@intrinsic
def _f2u(typingctx, x):  # pragma: no cover - compiled
    """The bits of a float32 as uint32 (a register bitcast)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _u2f(typingctx, x):  # pragma: no cover - compiled
    """The float32 whose bits are the uint32 x (a register bitcast)."""
    if x != types.uint32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@numba.njit(**_JIT)
def _key(x):  # pragma: no cover - compiled
    """An int32 that orders as the float32 x does (-0.0 just below +0.0)."""
    i = np.int32(_f2u(x))
    return np.int32(i ^ ((i >> 31) & np.int32(0x7FFFFFFF)))


@numba.njit(**_JIT)
def _unkey(k):  # pragma: no cover - compiled
    """Inverse of _key."""
    i = np.int32(k ^ ((k >> 31) & np.int32(0x7FFFFFFF)))
    return _u2f(np.uint32(i & np.int64(0xFFFFFFFF)))


@numba.njit(**_JIT)
def _bf16_round(x, up):  # pragma: no cover - compiled
    """bf16 bits of float32 x rounded toward +inf (up) or -inf: the v3 kernels' _bf16_round
    without its scratch array (a heap allocation per call: 8 per (layer, head) cost ~0.1 ms
    a block)."""
    u = _f2u(np.float32(x))
    hi = u >> np.uint32(16)
    if (u & np.uint32(0xFFFF)) != 0 and up != ((u >> np.uint32(31)) != 0):
        hi += np.uint32(1)                 # away from zero
    return np.uint16(hi)


@numba.njit(**_JIT)
def _bf16_value(bits):  # pragma: no cover - compiled
    return _u2f(np.uint32(np.uint32(bits) << np.uint32(16)))


# ------------------------------------------------------------------ 8 x 8 transposing moves
# The tile is worked channel-major, the block is token-major: every tile crosses a transpose.
# Element by element (strided loads or stores) that cost ~0.2 ns per element, the largest item
# of the encode; these move 8 x 8 blocks through vector registers (8 loads, 24 shuffles,
# 8 stores), written as LLVM IR because numba has no way to spell a shuffle.


def _transpose8(builder, rows):
    """The 8 x 8 transpose of eight <8 x T> vectors (unpack, then 2- and 4-element swaps)."""
    i32 = ir.IntType(32)

    def shuf(a, b, m):
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(i32, 8), m))

    t = []
    for k in range(0, 8, 2):
        t.append(shuf(rows[k], rows[k + 1], [0, 8, 1, 9, 4, 12, 5, 13]))
        t.append(shuf(rows[k], rows[k + 1], [2, 10, 3, 11, 6, 14, 7, 15]))
    tt = []
    for g in (0, 4):
        tt.append(shuf(t[g], t[g + 2], [0, 1, 8, 9, 4, 5, 12, 13]))
        tt.append(shuf(t[g], t[g + 2], [2, 3, 10, 11, 6, 7, 14, 15]))
        tt.append(shuf(t[g + 1], t[g + 3], [0, 1, 8, 9, 4, 5, 12, 13]))
        tt.append(shuf(t[g + 1], t[g + 3], [2, 3, 10, 11, 6, 7, 14, 15]))
    cols = [None] * 8
    for j in range(4):
        cols[j] = shuf(tt[j], tt[j + 4], [0, 1, 2, 3, 8, 9, 10, 11])
        cols[j + 4] = shuf(tt[j], tt[j + 4], [4, 5, 6, 7, 12, 13, 14, 15])
    return cols


def _ptr(builder, context, base, off, vty):
    """Pointer to element `off` of `base`, typed as a vector of `vty`."""
    return builder.bitcast(builder.gep(base, [off]), vty.as_pointer())


def _offsets(builder, context, start, stride):
    intp = context.get_value_type(types.intp)
    return [builder.add(start, builder.mul(stride, ir.Constant(intp, i))) for i in range(8)]


def _make_load(nblk: int, stages: bool):
    """An intrinsic (src, so, ss, Y, yo, ys, scale) -> ok: Y.flat[yo + j*ys + i] = element
    so + i*ss + j of `src` as float32 (uint16 bf16 bits or float32), i < 8, j < 8*nblk (nblk
    8 x 8 blocks side by side); ok is False when any of them is inf/NaN or past 2**MAX_EXP.
    With `stages`, the Hadamard stages whose pairs lie within the 8*nblk channels (1, 2, 4, ...
    apart) run on the registers before the store, then everything is multiplied by `scale`
    (the transform's scale when these were its last stages, else 1: exact), the same
    additions in the same order as _fwht_from, so the same bits."""

    @intrinsic
    def load(typingctx, src, so, ss, dst, do, ds, scale):  # pragma: no cover - compiled
        if src.dtype not in (types.uint16, types.float32) or dst.dtype != types.float32:
            return None
        sig = types.boolean(src, types.intp, types.intp, dst, types.intp, types.intp,
                            types.float32)

        def codegen(context, builder, signature, args):
            s = context.make_array(signature.args[0])(context, builder, args[0])
            d = context.make_array(signature.args[3])(context, builder, args[3])
            i32 = ir.IntType(32)
            intp = context.get_value_type(types.intp)
            v32 = ir.VectorType(i32, 8)
            vf = ir.VectorType(ir.FloatType(), 8)
            half = signature.args[0].dtype == types.uint16
            ity = ir.IntType(16) if half else i32
            vin = ir.VectorType(ity, 8)
            emask, ecarry = (0x7F80, _CARRY16) if half else (0x7F800000, _CARRY32)
            bad = ir.Constant(vin, None)
            cols = []
            for blk in range(nblk):
                rows = []
                start = builder.add(args[1], ir.Constant(intp, 8 * blk))
                for off in _offsets(builder, context, start, args[2]):
                    v = builder.load(_ptr(builder, context, s.data, off, vin),
                                     align=2 if half else 4)
                    bad = builder.or_(bad, builder.add(
                        builder.and_(v, ir.Constant(vin, [emask] * 8)),
                        ir.Constant(vin, [ecarry] * 8)))
                    if half:
                        v = builder.shl(builder.zext(v, v32), ir.Constant(v32, [16] * 8))
                    rows.append(v)
                cols += [builder.bitcast(c, vf) for c in _transpose8(builder, rows)]
            if stages:
                h = 1
                while h < 8 * nblk:
                    for j in range(8 * nblk):
                        if not j & h:
                            a, b = cols[j], cols[j + h]
                            cols[j], cols[j + h] = builder.fadd(a, b), builder.fsub(a, b)
                    h *= 2
                sc = builder.insert_element(ir.Constant(vf, None), args[6], ir.Constant(i32, 0))
                sc = builder.shuffle_vector(sc, sc, ir.Constant(v32, [0] * 8))
                cols = [builder.fmul(c, sc) for c in cols]
            for j, c in enumerate(cols):
                off = builder.add(args[4], builder.mul(args[5], ir.Constant(intp, j)))
                builder.store(c, _ptr(builder, context, d.data, off, vf), align=4)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ity, [vin]),
                                                f"llvm.vector.reduce.or.v8i{ity.width}")
            red = builder.call(fn, [bad])
            top = ir.Constant(ity, 1 << (ity.width - 1))
            return builder.icmp_unsigned("==", builder.and_(red, top), ir.Constant(ity, 0))

        return sig, codegen

    return load


_load8 = _make_load(1, False)
_load8_h1 = _make_load(1, True)     # Hadamard stages 1, 2, 4 on the registers
_load8_h2 = _make_load(2, True)     # ... 1 to 8
_load8_h4 = _make_load(4, True)     # ... 1 to 16


@intrinsic
def _store8(typingctx, src, so, ss, dst, do, ds):  # pragma: no cover - compiled
    """dst[do + i*ds + j] = src.flat[so + j*ss + i] for i, j < 8 (src float32 Y; dst uint16
    bf16 bits rounded to nearest even, or float32)."""
    if src.dtype != types.float32 or dst.dtype not in (types.uint16, types.float32):
        return None
    sig = types.void(src, types.intp, types.intp, dst, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        s = context.make_array(signature.args[0])(context, builder, args[0])
        d = context.make_array(signature.args[3])(context, builder, args[3])
        i32 = ir.IntType(32)
        v32 = ir.VectorType(i32, 8)
        vf = ir.VectorType(ir.FloatType(), 8)
        half = signature.args[3].dtype == types.uint16
        rows = [builder.bitcast(builder.load(_ptr(builder, context, s.data, off, vf), align=4),
                                v32)
                for off in _offsets(builder, context, args[1], args[2])]
        for off, v in zip(_offsets(builder, context, args[4], args[5]), _transpose8(builder, rows),
                          strict=True):
            if half:
                one = builder.and_(builder.lshr(v, ir.Constant(v32, [16] * 8)),
                                   ir.Constant(v32, [1] * 8))
                r = builder.add(builder.add(v, ir.Constant(v32, [0x7FFF] * 8)), one)
                v16 = ir.VectorType(ir.IntType(16), 8)
                r = builder.trunc(builder.lshr(r, ir.Constant(v32, [16] * 8)), v16)
                builder.store(r, _ptr(builder, context, d.data, off, v16), align=2)
            else:
                builder.store(builder.bitcast(v, vf), _ptr(builder, context, d.data, off, vf),
                              align=4)
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(**_JIT)
def _fwht_from(Y, h):  # pragma: no cover - compiled
    """In-place orthonormal Walsh-Hadamard transform of every column of Y[n, T] (n a power of
    two), from the stage whose pairs are h apart (the earlier ones done by the caller). The
    same butterflies in the same order as the v3 kernels' _fwht_cols (the bits v4 payloads were
    written with), the last stage scaling; each stage pair runs as four contiguous blocks of
    h*T elements (one long loop where _fwht_cols ran T-long ones: 0.19 -> 0.1 ms a block)."""
    n, T = Y.shape
    Yf = Y.reshape(n * T)
    s = np.float32(1.0 / np.sqrt(n))
    while 4 * h <= n:
        last = 4 * h == n
        m = h * T
        for i in range(0, n, 4 * h):
            A = Yf[i * T:i * T + m]
            B = Yf[i * T + m:i * T + 2 * m]
            C = Yf[i * T + 2 * m:i * T + 3 * m]
            E = Yf[i * T + 3 * m:i * T + 4 * m]
            if last:
                for x in range(m):
                    a = A[x]
                    b = B[x]
                    c = C[x]
                    d = E[x]
                    p = a + b
                    q = a - b
                    r = c + d
                    u = c - d
                    A[x] = (p + r) * s
                    B[x] = (q + u) * s
                    C[x] = (p - r) * s
                    E[x] = (q - u) * s
            else:
                for x in range(m):
                    a = A[x]
                    b = B[x]
                    c = C[x]
                    d = E[x]
                    p = a + b
                    q = a - b
                    r = c + d
                    u = c - d
                    A[x] = p + r
                    B[x] = q + u
                    C[x] = p - r
                    E[x] = q - u
        h *= 4
    if h < n:                       # an odd number of stages left: one radix-2 stage, scaling
        m = h * T
        A = Yf[:m]
        B = Yf[m:2 * m]
        for x in range(m):
            a = A[x]
            b = B[x]
            A[x] = (a + b) * s
            B[x] = (a - b) * s
    elif n == 1:
        for x in range(T):
            Yf[x] *= s


@numba.njit(**_JIT)
def _median(x, srt):  # pragma: no cover - compiled
    """Median of x (srt: scratch of its size). Insertion sort up to 64 values: numba's sort
    cost 0.5 us on 32, a tenth of the whole tile's work."""
    n = x.shape[0]
    if n > 64:
        srt[:] = x
        return _median_sorted(srt)
    for i in range(n):
        v = x[i]
        j = i
        while j > 0 and srt[j - 1] > v:
            srt[j] = srt[j - 1]
            j -= 1
        srt[j] = v
    if n % 2 == 1:
        return srt[(n - 1) // 2]
    return np.float32(0.5) * (srt[n // 2 - 1] + srt[n // 2])


# ------------------------------------------------------------------ encode


@numba.njit(**_JIT)
def _load_tile_fast(src16, src32, dt, base, HD, Y, rot):  # pragma: no cover - compiled
    """_load_tile by 8 x 8 blocks (D and T multiples of 8), and with `rot` the whole Hadamard
    transform, its stages within 32 channels on the registers (all of it up to D = 32, then
    one pass over Y for D = 64 and 128). False when any element is inf/NaN or past
    2**MAX_EXP."""
    D, T = Y.shape
    nb = min(D // 8, 4) if rot else 1
    scale = np.float32(1.0 / np.sqrt(D)) if rot and D == 8 * nb else np.float32(1.0)
    for t0 in range(0, T, 8):
        for d0 in range(0, D, 8 * nb):
            o = base + t0 * HD + d0
            yo = d0 * T + t0
            if dt == BF16:
                if nb == 4:
                    ok = _load8_h4(src16, o, HD, Y, yo, T, scale)
                elif nb == 2:
                    ok = _load8_h2(src16, o, HD, Y, yo, T, scale)
                elif rot:
                    ok = _load8_h1(src16, o, HD, Y, yo, T, scale)
                else:
                    ok = _load8(src16, o, HD, Y, yo, T, scale)
            elif nb == 4:
                ok = _load8_h4(src32, o, HD, Y, yo, T, scale)
            elif nb == 2:
                ok = _load8_h2(src32, o, HD, Y, yo, T, scale)
            elif rot:
                ok = _load8_h1(src32, o, HD, Y, yo, T, scale)
            else:
                ok = _load8(src32, o, HD, Y, yo, T, scale)
            if not ok:
                return False
    if rot:
        _fwht_from(Y, 8 * nb)
    return True


@numba.njit(**_JIT)
def _load_tile(src16, src32, dt, base, HD, X, Y):  # pragma: no cover - compiled
    """Y[d, t] = element base + t*HD + d as float32, channel-major, through the row scratch
    X[T, D] (contiguous loads, then an L1 transpose). False when any element is inf/NaN or
    of magnitude 2**MAX_EXP or more (its exponent plus _CARRY16/_CARRY32 carries into bit 15 /
    bit 31)."""
    T, D = X.shape
    Xu = X.view(np.uint32)
    bad = np.uint32(0)
    for t in range(T):
        o = base + t * HD
        xr = Xu[t]
        if dt == BF16:
            row = src16[o:o + D]
            for d in range(D):
                b = np.uint32(row[d])
                xr[d] = b << np.uint32(16)
                bad |= (b & np.uint32(0x7F80)) + np.uint32(_CARRY16)
        else:
            row32 = src32[o:o + D]
            for d in range(D):
                u = _f2u(row32[d])
                xr[d] = u
                bad |= (u & np.uint32(0x7F800000)) + np.uint32(_CARRY32)
    if dt == BF16:
        if bad & np.uint32(0x8000):
            return False
    elif bad & np.uint32(0x80000000):
        return False
    for d in range(D):
        yr = Y[d]
        for t in range(T):
            yr[t] = X[t, d]
    return True


@numba.njit(**_JIT)
def _col_norm_absmax(Y, vn, am):  # pragma: no cover - compiled
    """vn[t] = squared norm of column t (summed over d in order), am[t] = its max |Y[d, t]| as
    float bits, in one pass down the rows, four rows per loop (T-long loops cost as much to
    enter as to run; the sums keep their order, so their bits)."""
    D, T = Y.shape
    m = np.uint32(0x7FFFFFFF)
    for t in range(T):
        vn[t] = 0
        am[t] = 0
    d = 0
    while d + 4 <= D:
        y0 = Y[d]
        y1 = Y[d + 1]
        y2 = Y[d + 2]
        y3 = Y[d + 3]
        for t in range(T):
            a = y0[t]
            b = y1[t]
            c = y2[t]
            e = y3[t]
            vn[t] = (((vn[t] + a * a) + b * b) + c * c) + e * e
            am[t] = max(max(am[t], _f2u(a) & m, _f2u(b) & m), max(_f2u(c) & m, _f2u(e) & m))
        d += 4
    while d < D:
        yr = Y[d]
        for t in range(T):
            y = yr[t]
            vn[t] += y * y
            am[t] = max(am[t], _f2u(y) & m)
        d += 1


@numba.njit(**_JIT_SUM)
def _row_mean(yr, T):  # pragma: no cover - compiled
    s = np.float32(0.0)
    for t in range(T):
        s += yr[t]
    return s


@numba.njit(**_JIT)
def _col_dev(Y, mu, dev):  # pragma: no cover - compiled
    """dev[t] = squared distance of column t from the mean column (mu: scratch[D]), four rows
    per loop as _col_norm_absmax."""
    D, T = Y.shape
    for d in range(D):
        mu[d] = _row_mean(Y[d], T) / np.float32(T)
    for t in range(T):
        dev[t] = 0
    d = 0
    while d + 4 <= D:
        y0 = Y[d]
        y1 = Y[d + 1]
        y2 = Y[d + 2]
        y3 = Y[d + 3]
        m0 = mu[d]
        m1 = mu[d + 1]
        m2 = mu[d + 2]
        m3 = mu[d + 3]
        for t in range(T):
            a = y0[t] - m0
            b = y1[t] - m1
            c = y2[t] - m2
            e = y3[t] - m3
            dev[t] = (((dev[t] + a * a) + b * b) + c * c) + e * e
        d += 4
    while d < D:
        yr = Y[d]
        m = mu[d]
        for t in range(T):
            z = yr[t] - m
            dev[t] += z * z
        d += 1


@numba.njit(**_JIT)
def _hilo_out(a, b, n, hi, lo, d):  # pragma: no cover - compiled
    """hi[d], lo[d] from the integer keys a, b, with the signed zeros the first v4 kernel left
    (it took max(y + 0) and -max(0 - y)); 0 / -0 where no token is kept (n == 0)."""
    if n:
        hi[d] = _unkey(a) + np.float32(0.0)
        lo[d] = -(np.float32(0.0) - _unkey(b))
    else:
        hi[d] = 0.0
        lo[d] = -0.0


@numba.njit(**_JIT)
def _row_hilo(Y, keep, hi, lo):  # pragma: no cover - compiled
    """hi[d] / lo[d] = max / min of Y[d, t] over the tokens with keep[t] != 0 (integer keys:
    the reduction vectorizes; four rows per loop); 0 / -0 where no token is kept."""
    D, T = Y.shape
    lo_k = np.int32(_I32_MIN)
    hi_k = np.int32(_I32_MAX)
    n = 0
    for t in range(T):
        n += keep[t] != 0
    d = 0
    while d + 4 <= D:
        y0 = Y[d]
        y1 = Y[d + 1]
        y2 = Y[d + 2]
        y3 = Y[d + 3]
        a0 = a1 = a2 = a3 = lo_k
        b0 = b1 = b2 = b3 = hi_k
        for t in range(T):
            k = keep[t] != 0
            k0 = _key(y0[t])
            k1 = _key(y1[t])
            k2 = _key(y2[t])
            k3 = _key(y3[t])
            a0 = max(a0, k0 if k else lo_k)
            b0 = min(b0, k0 if k else hi_k)
            a1 = max(a1, k1 if k else lo_k)
            b1 = min(b1, k1 if k else hi_k)
            a2 = max(a2, k2 if k else lo_k)
            b2 = min(b2, k2 if k else hi_k)
            a3 = max(a3, k3 if k else lo_k)
            b3 = min(b3, k3 if k else hi_k)
        _hilo_out(a0, b0, n, hi, lo, d)
        _hilo_out(a1, b1, n, hi, lo, d + 1)
        _hilo_out(a2, b2, n, hi, lo, d + 2)
        _hilo_out(a3, b3, n, hi, lo, d + 3)
        d += 4
    while d < D:
        yr = Y[d]
        a = lo_k
        b = hi_k
        for t in range(T):
            k = _key(yr[t])
            a = max(a, k if keep[t] else lo_k)
            b = min(b, k if keep[t] else hi_k)
        _hilo_out(a, b, n, hi, lo, d)
        d += 1


@numba.njit(**_JIT)
def _code_i8(z, qmax):  # pragma: no cover - compiled
    nq = -qmax
    z = z if z > nq else nq            # compare-selects: they vectorize
    z = z if z < qmax else qmax
    return np.uint8(np.int32(_rint(z)) & 255)


@intrinsic
def _code_f8(typingctx, z, qmax):  # pragma: no cover - compiled
    """e4m3fn code of z clamped to +-qmax: round to nearest even on the float bits, codes below
    2**-6 (subnormal in e4m3) from the scaled value. In LLVM IR because numba widens every
    uint32 operation to 64 bits, which halved the vector width of this loop."""
    if z != types.float32 or qmax != types.float32:
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        f32 = ir.FloatType()
        x, q = args
        nq = builder.fneg(q)
        x = builder.select(builder.fcmp_ordered(">", x, nq), x, nq)
        x = builder.select(builder.fcmp_ordered("<", x, q), x, q)
        b = builder.bitcast(x, i32)
        u = builder.and_(b, ir.Constant(i32, 0x7FFFFFFF))
        sign = builder.and_(builder.lshr(b, ir.Constant(i32, 24)), ir.Constant(i32, 0x80))
        odd = builder.and_(builder.lshr(u, ir.Constant(i32, 20)), ir.Constant(i32, 1))
        r = builder.add(builder.add(u, ir.Constant(i32, 0x7FFFF)), odd)
        cn = builder.sub(builder.lshr(r, ir.Constant(i32, 20)), ir.Constant(i32, 120 << 3))
        top = ir.Constant(i32, 0x7E)
        cn = builder.select(builder.icmp_unsigned("<", cn, top), cn, top)
        ax = builder.bitcast(u, f32)                      # |x|
        m = ir.Constant(f32, 12582912.0)                  # round half to even, as _rint
        cs = builder.fsub(builder.fadd(builder.fmul(ax, ir.Constant(f32, 512.0)), m), m)
        cs = builder.fptosi(cs, i32)
        c = builder.select(builder.icmp_unsigned("<", u, ir.Constant(i32, 0x3C800000)), cs, cn)
        return builder.trunc(builder.or_(c, sign), ir.IntType(8))

    return types.uint8(types.float32, types.float32), codegen


@numba.njit(**_JIT)
def _quant_keys(Y, cen, inv, scl, tiny, qmax, fp8, codes, cbase):  # pragma: no cover
    """codes[cbase + d*T + t] = code of (Y[d, t] - cen[d]) * inv[d] (with tiny scales, whose
    inverse overflows float32: / scl[d])."""
    D, T = Y.shape
    for d in range(D):
        yr = Y[d]
        cr = codes[cbase + d * T:cbase + d * T + T]
        c = cen[d]
        a = inv[d]
        if tiny:
            a = scl[d]
            if fp8:
                for t in range(T):
                    cr[t] = _code_f8((yr[t] - c) / a, qmax)
            else:
                for t in range(T):
                    cr[t] = _code_i8((yr[t] - c) / a, qmax)
        elif fp8:
            for t in range(T):
                cr[t] = _code_f8((yr[t] - c) * a, qmax)
        else:
            for t in range(T):
                cr[t] = _code_i8((yr[t] - c) * a, qmax)


@numba.njit(**_JIT)
def _quant_values(Y, inv, scl, tiny, qmax, fp8, codes, cbase):  # pragma: no cover
    """codes[cbase + d*T + t] = code of Y[d, t] * inv[t] (tiny scales: / scl[t])."""
    D, T = Y.shape
    for d in range(D):
        yr = Y[d]
        cr = codes[cbase + d * T:cbase + d * T + T]
        if tiny:
            if fp8:
                for t in range(T):
                    cr[t] = _code_f8(yr[t] / scl[t], qmax)
            else:
                for t in range(T):
                    cr[t] = _code_i8(yr[t] / scl[t], qmax)
        elif fp8:
            for t in range(T):
                cr[t] = _code_f8(yr[t] * inv[t], qmax)
        else:
            for t in range(T):
                cr[t] = _code_i8(yr[t] * inv[t], qmax)


@numba.njit(**_JIT)
def _exps(need, base, thr, M, e_out):  # pragma: no cover - compiled
    """e_out[i] = largest e in 0..255 with base * 2**(-e/STEPS) >= need[i] (need <= base):
    with r = need/base = m * 2**k (m in [1, 2)), e = -STEPS*k - #{j < STEPS: thr[j] < m},
    thr[j] = 2**(j/STEPS) as float32. The v3 kernels' _exps finds the same count with a table
    and two data-dependent comparisons per element (~15 cycles each, scalar); counting all
    STEPS comparisons across a vector of elements is ~5x faster. M: float32 scratch."""
    n = need.shape[0]
    for i in range(n):
        u = _f2u(need[i] / base)
        M[i] = _u2f(np.uint32((u & np.uint32(0x7FFFFF)) | np.uint32(0x3F800000)))
        e_out[i] = 0
    for j in range(STEPS):
        tj = thr[j]
        for i in range(n):
            e_out[i] += np.int32(tj < M[i])
    for i in range(n):
        u = _f2u(need[i] / base)
        k = np.int32(u >> np.uint32(23)) - np.int32(127)
        e = np.int32(-STEPS) * k - e_out[i]
        e = min(max(e, np.int32(0)), np.int32(255))
        e_out[i] = np.int32(255) if need[i] <= 0 or u == 0 else e


@numba.njit(**_JIT)
def _value_scales(am, qmax, skip, tsc):  # pragma: no cover - compiled
    """tsc[t] = max |value| of token t / qmax; returns their maximum over t != skip (all >= 0,
    so compared as integer bits: a float max does not vectorize)."""
    T = am.shape[0]
    m = np.uint32(0)
    for t in range(T):
        v = _u2f(am[t]) / qmax
        tsc[t] = v
        m = max(m, np.uint32(_f2u(v) if t != skip else 0))
    return _u2f(m)


@numba.njit(**_JIT)
def _centres(hi, lo, cen):  # pragma: no cover - compiled
    """cen[d] = the middle of [lo[d], hi[d]]; returns (min, max) of cen (integer keys)."""
    D = cen.shape[0]
    a = np.int32(_I32_MAX)
    b = np.int32(_I32_MIN)
    for d in range(D):
        c = np.float32(0.5) * hi[d] + np.float32(0.5) * lo[d]
        cen[d] = c
        k = _key(c)
        a = min(a, k)
        b = max(b, k)
    return _unkey(a), _unkey(b)


@numba.njit(**_JIT)
def _key_grid(cen, hi, lo, c0, st, qmax, kidx, need):  # pragma: no cover - compiled
    """Each channel's centre to the nearest of c0 + i*st (i in 0..255: kidx), cen[d] set to it,
    need[d] = the scale the channel then needs; returns the largest need (all >= 0)."""
    D = cen.shape[0]
    m = np.uint32(0)
    for d in range(D):
        ix = np.int32(0)
        if st > 0:
            ix = np.int32(_rint((cen[d] - c0) / st))
            ix = min(max(ix, np.int32(0)), np.int32(255))
        kidx[d] = np.uint8(ix)
        o = c0 + np.float32(ix) * st
        cen[d] = o
        a = hi[d] - o
        b = o - lo[d]
        v = (a if a > b else b) / qmax
        need[d] = v
        m = max(m, _f2u(v))
    return _u2f(np.uint32(m))


@numba.njit(**_JIT)
def _scales(e, base, exp_lut, scl, inv):  # pragma: no cover - compiled
    """scl[i] = base * 2**(-e[i]/STEPS) (the table), inv[i] = 1 / scl[i]."""
    n = e.shape[0]
    for i in range(n):
        v = base * exp_lut[e[i]]
        scl[i] = v
        inv[i] = np.float32(1.0) / v


@numba.njit(**_JIT)
def _load_rot(src16, src32, dt, base, HD, X, Y, rot, fast):  # pragma: no cover - compiled
    """Y = the tile at `base`, channel-major, Hadamard-transformed over D when `rot`; False on
    inf/NaN. `fast`: D and T are multiples of 8 (8 x 8 register blocks)."""
    if fast:
        return _load_tile_fast(src16, src32, dt, base, HD, Y, rot)
    if not _load_tile(src16, src32, dt, base, HD, X, Y):
        return False
    if rot:
        _fwht_from(Y, 1)
    return True


@numba.njit(**_JIT)
def q4_encode(src16, src32, dt, L, T, H, D, fp8, rot_k, rot_v, sink_ratio, vsink_ratio, kout_ratio,
              exp_lut, slab, kidx, kexp, vexp, codes, xk, xv, blocks8):  # pragma: no cover
    """Quantize one canonical block [L,2,T,H,D] into the v4 sections (lossy.py).

    Per (layer, head), channel-major (Y[d, t]): keys and values optionally Hadamard-rotated
    (rot_k, rot_v); values one scale per token; keys per channel a centre (8-bit index on a
    grid between the slab's smallest and largest centre) and a scale. Tokens kept exact
    (flagged in xk / xv, their raw bytes stored by the caller) stay out of the statistics: the
    value sink (squared value norm < sink_ratio**2 x the median) has its key and value exact;
    the key farthest from the channel means, when its distance is > kout_ratio x the median
    distance, has its key exact. blocks8: move tiles by 8 x 8 register blocks where D and T
    allow (False: element by element; the same result). Returns 0, or 1 when the block holds
    inf/NaN."""
    qmax = np.float32(448.0) if fp8 else np.float32(127.0)
    Y = np.empty((D, T), np.float32)
    X = np.empty((T, D), np.float32)
    hi = np.empty(D, np.float32)
    lo = np.empty(D, np.float32)
    cen = np.empty(D, np.float32)
    need = np.empty(D, np.float32)
    dinv = np.empty(D, np.float32)
    dsc = np.empty(D, np.float32)
    am = np.empty(T, np.uint32)
    vn = np.empty(T, np.float32)
    dev = np.empty(T, np.float32)
    srt = np.empty(T, np.float32)
    tinv = np.empty(T, np.float32)
    tsc = np.empty(T, np.float32)
    keep = np.empty(T, np.uint8)
    thr = np.empty(STEPS + 1, np.float32)
    for j in range(STEPS + 1):
        thr[j] = np.float32(2.0 ** (j / STEPS))
    rt = np.empty(T, np.float32)
    rd = np.empty(D, np.float32)
    et = np.empty(T, np.int32)
    ed = np.empty(D, np.int32)
    HD = H * D
    DT = D * T
    fast = blocks8 and D % 8 == 0 and T % 8 == 0
    for ly in range(L):
        for h in range(H):
            for t in range(T):
                xk[ly, t, h] = False
                xv[ly, t, h] = False
            # ---- values: norms (sink rule), rotation, one scale per token
            if not _load_rot(src16, src32, dt, ((ly * 2 + 1) * T * H + h) * D, HD, X, Y, rot_v,
                             fast):      # the rotation keeps the norms the sink rule reads
                return 1
            _col_norm_absmax(Y, vn, am)
            sink = -1
            if T > 1:
                med = _median(vn, srt)
                tmin = 0
                for t in range(1, T):
                    if vn[t] < vn[tmin]:
                        tmin = t
                if vn[tmin] < np.float32(sink_ratio * sink_ratio) * med:
                    sink = tmin
                    xk[ly, sink, h] = True
                    xv[ly, sink, h] = vn[tmin] < np.float32(vsink_ratio * vsink_ratio) * med
            vmax = _value_scales(am, qmax, sink if sink >= 0 and xv[ly, sink, h] else -1, tsc)
            vb_bits = _bf16_round(vmax, True) if vmax > 0 else np.uint16(0x3F80)
            vb = _bf16_value(vb_bits)
            for t in range(T):
                tsc[t] = tsc[t] if tsc[t] < vb else vb
            _exps(tsc, vb, thr, rt, et)
            _scales(et, vb, exp_lut, tsc, tinv)
            for t in range(T):
                vexp[ly, t, h] = et[t]
            _quant_values(Y, tinv, tsc, vb < TINY, qmax, fp8, codes, ((ly * 2 + 1) * H + h) * DT)
            # ---- keys: the outlier key, then one centre and one scale per channel
            if not _load_rot(src16, src32, dt, ((ly * 2) * T * H + h) * D, HD, X, Y, rot_k, fast):
                return 1
            _col_dev(Y, dsc, dev)
            keep[:] = 1
            if sink >= 0:
                keep[sink] = 0
            if T > 2:
                dmed = _median(dev, srt)
                tout = -1
                for t in range(T):
                    if t != sink and (tout < 0 or dev[t] > dev[tout]):
                        tout = t
                if dev[tout] > np.float32(kout_ratio * kout_ratio) * dmed:
                    xk[ly, tout, h] = True
                    keep[tout] = 0
            _row_hilo(Y, keep, hi, lo)
            cmin, cmax = _centres(hi, lo, cen)
            cmin_bits = _bf16_round(cmin, False)
            c0 = _bf16_value(cmin_bits)
            step = (cmax - c0) / np.float32(255.0) * np.float32(1.01)
            step_bits = _bf16_round(step, True) if step > 0 else np.uint16(0)
            st = _bf16_value(step_bits)
            kmax = _key_grid(cen, hi, lo, c0, st, qmax, kidx[ly, h], need)
            kb_bits = _bf16_round(kmax, True) if kmax > 0 else np.uint16(0x3F80)
            kb = _bf16_value(kb_bits)
            slab[ly, h, 0] = cmin_bits
            slab[ly, h, 1] = step_bits
            slab[ly, h, 2] = kb_bits
            slab[ly, h, 3] = vb_bits
            _exps(need, kb, thr, rd, ed)
            _scales(ed, kb, exp_lut, dsc, dinv)
            kr = kexp[ly, h]
            for d in range(D):
                kr[d] = ed[d]
            _quant_keys(Y, cen, dinv, dsc, kb < TINY, qmax, fp8, codes, ((ly * 2) * H + h) * DT)
    return 0


@numba.njit(**_JIT)
def _put_u32(buf, pos, v):  # pragma: no cover - compiled
    for i in range(4):
        buf[pos + i] = np.uint8((v >> (8 * i)) & 255)


@numba.njit(**_JIT)
def _exact_positions(mask, buf, pos, wide):  # pragma: no cover - compiled
    """u32 count, then the ascending flat positions of mask (u32 if wide, else u16)."""
    n = 0
    for f in range(mask.shape[0]):
        n += mask[f]
    _put_u32(buf, pos, n)
    pos += 4
    w = 4 if wide else 2
    for f in range(mask.shape[0]):
        if mask[f]:
            for i in range(w):
                buf[pos + i] = np.uint8((f >> (8 * i)) & 255)
            pos += w
    return pos


@numba.njit(**_JIT)
def _exact_lows(block, item, mask, j, T, H, D, codes, buf, pos):  # pragma: no cover
    """For each flagged token (flat [L,T,H] order) of part j (0 keys, 1 values): its elements'
    bytes but the top one into buf at pos, the top one into the token's code slots."""
    TH = T * H
    for f in range(mask.shape[0]):
        if not mask[f]:
            continue
        ly = f // TH
        t = (f % TH) // H
        h = f % H
        e = ((ly * 2 + j) * TH + t * H + h) * D * item
        c = ((ly * 2 + j) * H + h) * D * T + t
        src = block[e:e + D * item]
        low = buf[pos:pos + D * (item - 1)]
        if item == 2:
            for d in range(D):
                low[d] = src[2 * d]
        else:
            for d in range(D):
                for b in range(item - 1):
                    low[d * (item - 1) + b] = src[d * item + b]
        cs = codes[c:c + (D - 1) * T + 1]
        for d in range(D):
            cs[d * T] = src[d * item + item - 1]
        pos += D * (item - 1)
    return pos


@numba.njit(**_JIT)
def q4_pack_exact(block, item, L, T, H, D, codes, xk, xv, buf, pos, wide):  # pragma: no cover
    """The v4 payload's exact-token section (lossy.py) into buf from pos: for keys
    (xk) then values (xv) when any is flagged, a u32 count and the positions; then the keys'
    lower bytes, then the values'; each exact element's top byte into its code slot.
    Returns (end, flags: 1 keys present, 2 values present), or (-1, 0) when buf is too short
    (a caller bug)."""
    n = L * T * H
    km = xk.reshape(n)
    vm = xv.reshape(n)
    nk = 0
    nv = 0
    for f in range(n):
        nk += km[f]
        nv += vm[f]
    w = 4 if wide else 2
    need = pos + (8 if nk else 0) + (8 if nv else 0) + (nk + nv) * (w + D * (item - 1)) - (
        4 if nk and not nv else 0) - (4 if nv and not nk else 0)
    if need > buf.shape[0]:
        return -1, 0
    flags = 0
    if nk:
        pos = _exact_positions(km, buf, pos, wide)
        flags |= 1
    if nv:
        pos = _exact_positions(vm, buf, pos, wide)
        flags |= 2
    if nk:
        pos = _exact_lows(block, item, km, 0, T, H, D, codes, buf, pos)
    if nv:
        pos = _exact_lows(block, item, vm, 1, T, H, D, codes, buf, pos)
    return pos, flags


# ------------------------------------------------------------------ decode


@numba.njit(**_JIT)
def q4_unpack_exact(out, item, T, H, D, codes, where, j, buf, pos):  # pragma: no cover
    """Inverse of _exact_lows: the tokens at flat [L,T,H] positions `where` (ascending, in
    range: checked by the caller) of part j get their elements back from the lower bytes at
    buf[pos:] and the top bytes in their code slots. Returns the position after them."""
    TH = T * H
    for i in range(where.shape[0]):
        f = where[i]
        ly = f // TH
        t = (f % TH) // H
        h = f % H
        e = ((ly * 2 + j) * TH + t * H + h) * D * item
        c = ((ly * 2 + j) * H + h) * D * T + t
        dst = out[e:e + D * item]
        low = buf[pos:pos + D * (item - 1)]
        cs = codes[c:c + (D - 1) * T + 1]
        for d in range(D):
            for b in range(item - 1):
                dst[d * item + b] = low[d * (item - 1) + b]
            dst[d * item + item - 1] = cs[d * T]
        pos += D * (item - 1)
    return pos




@numba.njit(**_JIT)
def _f8_value(c):  # pragma: no cover - compiled
    """Value of e4m3fn code c from its bits (as legacy/lossy_v3.F8_LUT: 0x7f/0xff give 480)."""
    c = np.uint32(c)
    e = (c >> np.uint32(3)) & np.uint32(15)
    m = c & np.uint32(7)
    sub = _f2u(np.float32(m) * np.float32(2.0 ** -9))
    nrm = ((e + np.uint32(120)) << np.uint32(23)) | (m << np.uint32(20))
    u = nrm if e != 0 else sub
    return _u2f(np.uint32(u | ((c & np.uint32(0x80)) << np.uint32(24))))


@numba.njit(**_JIT)
def _dequant_keys(codes, cbase, cen, scl, fp8, Y):  # pragma: no cover - compiled
    """Y[d, t] = cen[d] + value(codes[cbase + d*T + t]) * scl[d]."""
    D, T = Y.shape
    for d in range(D):
        yr = Y[d]
        cr = codes[cbase + d * T:cbase + d * T + T]
        c = cen[d]
        a = scl[d]
        if fp8:
            for t in range(T):
                yr[t] = c + _f8_value(cr[t]) * a
        else:
            for t in range(T):
                yr[t] = c + np.float32(np.int8(cr[t])) * a


@numba.njit(**_JIT)
def _dequant_values(codes, cbase, scl, fp8, Y):  # pragma: no cover - compiled
    """Y[d, t] = 0 + value(codes[cbase + d*T + t]) * scl[t] (the + 0 turns -0 into +0, as the
    first v4 decoder did)."""
    D, T = Y.shape
    z = np.float32(0.0)
    for d in range(D):
        yr = Y[d]
        cr = codes[cbase + d * T:cbase + d * T + T]
        if fp8:
            for t in range(T):
                yr[t] = z + _f8_value(cr[t]) * scl[t]
        else:
            for t in range(T):
                yr[t] = z + np.float32(np.int8(cr[t])) * scl[t]


@numba.njit(**_JIT)
def _store_tile(Y, X, dt, base, HD, dst16, dst32, fast):  # pragma: no cover - compiled
    """Element base + t*HD + d = Y[d, t], rounded to bf16 (nearest even) or as float32: by
    8 x 8 register blocks when `fast` (D and T multiples of 8), else through the row scratch
    X[T, D] (an L1 transpose, then contiguous stores)."""
    D, T = Y.shape
    if fast:
        for t0 in range(0, T, 8):
            for d0 in range(0, D, 8):
                if dt == BF16:
                    _store8(Y, d0 * T + t0, T, dst16, base + t0 * HD + d0, HD)
                else:
                    _store8(Y, d0 * T + t0, T, dst32, base + t0 * HD + d0, HD)
        return
    for t in range(T):
        xr = X[t]
        for d in range(D):
            xr[d] = Y[d, t]
    for t in range(T):
        o = base + t * HD
        xr = X[t]
        if dt == BF16:
            row = dst16[o:o + D]
            for d in range(D):
                u = _f2u(xr[d])
                row[d] = np.uint16((u + np.uint32(0x7FFF) + (
                    (u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        else:
            row32 = dst32[o:o + D]
            for d in range(D):
                row32[d] = xr[d]


@numba.njit(**_JIT)
def q4_decode(dst16, dst32, dt, L, T, H, D, fp8, rot_k, rot_v, exp_lut, slab, kidx, kexp, vexp,
              codes, blocks8):  # pragma: no cover - compiled
    """Inverse of q4_encode (exact tokens are written by the caller afterwards; blocks8 as
    there).
    Returns 0, or 2 when the side info is not finite/positive (a corrupt payload)."""
    Y = np.empty((D, T), np.float32)
    X = np.empty((T, D), np.float32)
    cen = np.empty(D, np.float32)
    dsc = np.empty(D, np.float32)
    tsc = np.empty(T, np.float32)
    HD = H * D
    DT = D * T
    fast = blocks8 and D % 8 == 0 and T % 8 == 0
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
            _dequant_keys(codes, ((ly * 2) * H + h) * DT, cen, dsc, fp8, Y)
            if rot_k:
                _fwht_from(Y, 1)
            _store_tile(Y, X, dt, ((ly * 2) * T * H + h) * D, HD, dst16, dst32, fast)
            _dequant_values(codes, ((ly * 2 + 1) * H + h) * DT, tsc, fp8, Y)
            if rot_v:
                _fwht_from(Y, 1)
            _store_tile(Y, X, dt, ((ly * 2 + 1) * T * H + h) * D, HD, dst16, dst32, fast)
    return 0
