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
from kvstore_client.errors import DataLoss
from kvstore_client.layout import KVLayout

from .codec_common import cctx, check_block, scratch, zstd_decompress_into

VERSION = 1
F_ZSTD = 1
_HDR = struct.Struct("<BBBB")
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
    check_block(block, layout)
    planes = scratch("planes", block.nbytes)
    size = _planes(layout, block.nbytes)
    shuffle(block, size, planes)
    comp = cctx().compress(planes)
    if len(comp) >= block.nbytes:   # incompressible (e.g. random bits): store planes as is
        return _HDR.pack(VERSION, 0, size, 0) + planes.tobytes()
    return _HDR.pack(VERSION, F_ZSTD, size, 0) + comp


def decode(payload, layout: KVLayout, out: np.ndarray) -> None:
    check_block(out, layout, "out")
    mv = memoryview(payload).cast("B")
    if len(mv) < _HDR.size:
        raise DataLoss(f"lossless payload is {len(mv)} bytes, shorter than its header")
    version, flags, nplanes, reserved = _HDR.unpack_from(mv)
    if version != VERSION:
        raise DataLoss(f"lossless payload version {version} is not supported (expected {VERSION})")
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
