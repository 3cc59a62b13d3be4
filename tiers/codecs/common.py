"""Shared pieces of the codecs: per-thread zstd contexts and scratch buffers, the block check,
and the loaders of the compiled kernels.

Why per thread: zstd contexts are not thread-safe but are costly to create, and zstd releases the
GIL, so each demotion thread keeps its own. Why scratch buffers: glibc maps every new multi-MiB
buffer fresh, so a buffer allocated per block costs a round of page faults each time (several
times slower than the codec itself, docs/performance.md); reusing one per thread keeps the codec
at memory speed.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from kvstore_client.common.errors import DataLoss, InvalidArgument
from kvstore_client.common.layout import KVLayout
from kvstore_client.common.lazy import lazy_module

if TYPE_CHECKING:
    import numpy as np
    import zstandard as zstd
else:   # on first use: importing the codecs (the daemon's first demotion) does not pay them
    np = lazy_module("numpy", globals(), "np")
    zstd = lazy_module("zstandard", globals(), "zstd")

# zstd level for every codec, chosen by measurement on real bf16 KV (docs/codecs.md): level 1
# gives nearly all of the ratio of level 3 at 3x the speed; negative levels skip entropy coding
# of literals, which is where all of the gain on float planes comes from.
ZSTD_LEVEL = 1

_tls = threading.local()


def lossless_kernels():
    """The compiled kernels of the lossless codec (lossless_kernels.py), imported on first
    use: numba is a heavy import that a daemon with no codec work never pays."""
    from . import lossless_kernels
    return lossless_kernels


def lossy_kernels():
    """The compiled kernels of the lossy payload v4 (lossy_kernels.py), imported on first use,
    as lossless_kernels()."""
    from . import lossy_kernels
    return lossy_kernels


class NonFiniteBlock(ValueError):
    """A lossy codec refuses a block holding inf or NaN (the caller stores it losslessly).

    Defined here, not beside the lossy codecs, so catching it never imports torch."""


def cctx() -> zstd.ZstdCompressor:
    c = getattr(_tls, "cctx", None)
    if c is None:
        # No content checksum: the frame header already carries an xxh3 of the whole payload.
        c = _tls.cctx = zstd.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    return c


def dctx() -> zstd.ZstdDecompressor:
    d = getattr(_tls, "dctx", None)
    if d is None:
        d = _tls.dctx = zstd.ZstdDecompressor()
    return d


def scratch(name: str, nbytes: int) -> np.ndarray:
    """A reusable per-thread uint8 buffer of at least `nbytes` (contents undefined)."""
    bufs = getattr(_tls, "bufs", None)
    if bufs is None:
        bufs = _tls.bufs = {}
    b = bufs.get(name)
    if b is None or b.nbytes < nbytes:
        b = np.empty(max(nbytes, 4096), np.uint8)
        bufs[name] = b
    return b[:nbytes]


def zstd_decompress_into(payload, dst: np.ndarray, what: str) -> None:
    """Decompress one zstd frame into `dst` exactly; DataLoss if it is corrupt or the wrong size."""
    try:
        size = zstd.frame_content_size(payload)
    except zstd.ZstdError as e:
        raise DataLoss(f"{what}: not a zstd frame ({e})") from None
    if size != dst.nbytes:
        raise DataLoss(f"{what}: zstd frame holds {size} bytes, expected {dst.nbytes}")
    mv = memoryview(dst).cast("B")
    got = 0
    try:
        with dctx().stream_reader(payload, read_across_frames=False) as r:
            while got < dst.nbytes:
                n = r.readinto(mv[got:])
                if n == 0:
                    break
                got += n
            extra = r.read(1)
    except zstd.ZstdError as e:
        raise DataLoss(f"{what}: zstd data is corrupt ({e})") from None
    if got != dst.nbytes or extra:
        raise DataLoss(f"{what}: zstd data decoded to the wrong length")


def check_block(block: np.ndarray, layout: KVLayout, what: str = "block") -> np.ndarray:
    """Validate a caller-supplied raw block / output buffer (a caller bug, not data loss)."""
    if not isinstance(block, np.ndarray) or block.dtype != np.uint8 or block.ndim != 1:
        raise InvalidArgument(f"{what} must be a 1-D uint8 numpy array")
    if block.nbytes != layout.block_bytes:
        raise InvalidArgument(f"{what} is {block.nbytes} bytes; the layout needs "
                              f"{layout.block_bytes}")
    if not block.flags.c_contiguous:
        raise InvalidArgument(f"{what} must be contiguous")
    return block
