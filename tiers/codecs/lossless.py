"""`lossless` codec: byte-shuffle into planes, then zstd. Bit-exact, inf/NaN included.

Why shuffle: in a 16-bit float the high byte (sign and exponent) of neighbouring values is highly
repetitive while the low byte (mantissa) is nearly random; interleaved, zstd sees noise.
Splitting the bytes into planes (2 for 16-bit dtypes, 4 for fp32) lets zstd's entropy coder
squeeze the exponent plane. Shuffle and unshuffle are whole-block numpy shifts (several GB/s),
so zstd is the cost.

Payload (little-endian):
    0  u8   version (1)
    1  u8   flags: bit 0 = planes are zstd-compressed (else stored as is)
    2  u8   planes (== itemsize of the layout dtype)
    3  u8   reserved (0)
    4  ...  the planes (raw_len bytes), or one zstd frame of them
"""

from __future__ import annotations

import struct

import numpy as np
from kvstore_client.common.errors import DataLoss
from kvstore_client.common.layout import KVLayout

from .common import cctx, check_block, scratch, zstd_decompress_into
from .common import lossless_kernels as _kernels

VERSION = 2
F_ZSTD = 1                 # v1: planes are one zstd frame
F_PACKED = 2               # v2: top byte 4-bit coded (else the block as is)
_HDR = struct.Struct("<BBBB")
_V2 = struct.Struct("<BBBB16sI")    # + dictionary (15 top bytes, 1 pad), escape count
SAMPLE = 16                # top-byte histogram from every 16th element
STORE_RAW_ABOVE = 0.97     # keep the block as is unless the payload is < 97% of it
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _planes(layout: KVLayout, nbytes: int) -> int:
    """Bytes per element to shuffle by: the dtype's, or 1 for opaque bytes it does not divide."""
    size = layout.itemsize
    return size if size in _UINT and nbytes % size == 0 else 1


def shuffle(block: np.ndarray, itemsize: int, planes: np.ndarray) -> None:
    """planes[i*n:(i+1)*n] = byte i of every element (little-endian), by shifts, no strided copy."""
    words = block.view(_UINT[itemsize])
    n = words.size
    tmp = scratch("shuffle_tmp", words.nbytes).view(_UINT[itemsize])
    for i in range(itemsize):
        src = words
        if i:
            np.right_shift(words, 8 * i, out=tmp)
            src = tmp
        np.copyto(planes[i * n:(i + 1) * n], src, casting="unsafe")


def unshuffle(planes: np.ndarray, itemsize: int, out: np.ndarray) -> None:
    words = out.view(_UINT[itemsize])
    n = words.size
    ut = _UINT[itemsize]
    np.copyto(words, planes[(itemsize - 1) * n:], casting="unsafe")
    for i in range(itemsize - 2, -1, -1):
        np.left_shift(words, ut(8), out=words)
        np.bitwise_or(words, planes[i * n:(i + 1) * n], out=words)


def encode(block: np.ndarray, layout: KVLayout) -> bytes:
    """Block -> v2 payload: the top byte of every element as a 4-bit code, the rest raw, or the
    block as is when that would not be smaller (flag bit 1 clear)."""
    check_block(block, layout)
    size = _planes(layout, block.nbytes)
    n = block.nbytes // size
    if size == 1 or n < 2:
        return _HDR.pack(VERSION, 0, size, 0) + block.tobytes()
    words = block.reshape(n, size)
    top = words[::SAMPLE, size - 1]
    counts = np.bincount(top, minlength=256)
    order = np.argsort(-counts, kind="stable")[:15]
    dic = np.zeros(16, np.uint8)
    dic[:15] = order
    lut = np.full(256, 15, np.uint8)
    lut[order] = np.arange(15, dtype=np.uint8)
    est = (counts.sum() - counts[order].sum()) * SAMPLE      # escapes, from the sample
    nib = (n + 1) // 2
    if nib + est >= n * STORE_RAW_ABOVE:    # the top plane would barely shrink: store as is
        return _HDR.pack(VERSION, 0, size, 0) + block.tobytes()
    low_at = _V2.size
    nib_at = low_at + (size - 1) * n
    esc_at = nib_at + nib
    buf = scratch("ll_payload", esc_at + n)
    n_esc = _kernels().ll_encode(block, size, lut, buf, low_at, nib_at, esc_at)
    if nib + n_esc >= n * STORE_RAW_ABOVE:     # the sample was wrong: store as is after all
        return _HDR.pack(VERSION, 0, size, 0) + block.tobytes()
    _V2.pack_into(buf, 0, VERSION, F_PACKED, size, 0, dic.tobytes(), n_esc)
    return buf[:esc_at + n_esc].tobytes()


def decode(payload, layout: KVLayout, out: np.ndarray) -> None:
    check_block(out, layout, "out")
    mv = memoryview(payload).cast("B")
    if len(mv) < _HDR.size:
        raise DataLoss(f"lossless payload is {len(mv)} bytes, shorter than its header")
    version, flags, nplanes, reserved = _HDR.unpack_from(mv)
    if version == 1:
        _decode_v1(mv, layout, out, flags, nplanes, reserved)
        return
    if version != VERSION:
        raise DataLoss(f"lossless payload version {version} is not supported (expected 1 or "
                       f"{VERSION})")
    if flags & ~F_PACKED or reserved:
        raise DataLoss(f"lossless payload has unknown flags {flags:#x}/{reserved:#x}")
    size = _planes(layout, out.nbytes)
    if nplanes != size:
        raise DataLoss(f"lossless payload has {nplanes} byte planes; the namespace dtype "
                       f"{layout.dtype} needs {size}")
    if not flags & F_PACKED:
        body = mv[_HDR.size:]
        if len(body) != out.nbytes:
            raise DataLoss(f"lossless payload holds {len(body)} bytes, expected {out.nbytes}")
        out[:] = np.frombuffer(body, np.uint8)
        return
    if len(mv) < _V2.size or size < 2:
        raise DataLoss(f"lossless payload is {len(mv)} bytes, shorter than its v2 header")
    *_, dic, n_esc = _V2.unpack_from(mv)
    n = out.nbytes // size
    nib = (n + 1) // 2
    if n_esc > n or len(mv) != _V2.size + nib + n_esc + (size - 1) * n:
        raise DataLoss(f"lossless payload is {len(mv)} bytes; {n} elements with {n_esc} "
                       f"escapes need {_V2.size + nib + n_esc + (size - 1) * n}")
    body = np.frombuffer(mv, np.uint8)
    low_at = _V2.size
    nib_at = low_at + (size - 1) * n
    st = _kernels().ll_decode(body, size, np.frombuffer(dic, np.uint8), low_at, nib_at,
                              nib_at + nib, n_esc, out)
    if st:
        raise DataLoss("lossless payload's escape codes do not match its escape bytes")


def _decode_v1(mv: memoryview, layout: KVLayout, out: np.ndarray, flags: int, nplanes: int,
               reserved: int) -> None:
    """Payloads written before v2: byte planes, zstd-compressed or as is."""
    if flags & ~F_ZSTD or reserved:
        raise DataLoss(f"lossless payload has unknown flags {flags:#x}/{reserved:#x}")
    size = _planes(layout, out.nbytes)
    if nplanes != size:
        raise DataLoss(f"lossless payload has {nplanes} byte planes; the namespace dtype "
                       f"{layout.dtype} needs {size}")
    body = mv[_HDR.size:]
    planes = scratch("planes", out.nbytes)
    if flags & F_ZSTD:
        zstd_decompress_into(body, planes, "lossless payload")
    else:
        if len(body) != out.nbytes:
            raise DataLoss(f"lossless payload holds {len(body)} plane bytes, expected "
                           f"{out.nbytes}")
        planes[:] = np.frombuffer(body, np.uint8)
    unshuffle(planes, size, out)


def encode_v1(block: np.ndarray, layout: KVLayout) -> bytes:
    """The v1 format (byte planes + zstd-1): kept so tests can check old payloads decode."""
    check_block(block, layout)
    planes = scratch("planes", block.nbytes)
    size = _planes(layout, block.nbytes)
    shuffle(block, size, planes)
    comp = cctx().compress(planes)
    if len(comp) >= block.nbytes:
        return _HDR.pack(1, 0, size, 0) + planes.tobytes()
    return _HDR.pack(1, F_ZSTD, size, 0) + comp
