"""Arrays and tensors as block bytes: dtype-checked integer views, slot views, copies.

Why a module of its own: the dense (`namespace.py`) and paged (`paged.py`) layouts, and the GPU
path, all move blocks as same-size integers so copies never convert, and all need the same
page-aligned, pre-faulted staging buffers (docs/performance.md: alignment and page faults). torch
is optional: it is looked up in `sys.modules`, never imported here.
"""

from __future__ import annotations

import mmap
import sys
import threading
from typing import Any

import numpy as np

from .common.errors import InvalidArgument
from .common.layout import KVLayout

PAGE = 4096

_NP_DTYPES = {"float16": np.float16, "float32": np.float32, "bfloat16": np.uint16}
_RAW = {2: np.int16, 4: np.int32, 8: np.int64}


def _torch() -> Any:
    return sys.modules.get("torch")


def _is_tensor(x: Any) -> bool:
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def raw_view(x: Any, layout: KVLayout, what: str) -> Any:
    """`x` reinterpreted as same-size integers (a view, never a copy), after checking its dtype.

    Returns a numpy array for numpy inputs and CPU tensors (so copies use numpy's memcpy loops),
    and an integer-typed tensor for device tensors (copied with torch). The integer view makes
    the copy a pure byte move: no float conversion, no NaN canonicalisation, and bfloat16 needs
    no numpy support.
    """
    isz = layout.itemsize
    if _is_tensor(x):
        t = _torch()
        name = str(x.dtype).removeprefix("torch.")
        if name != layout.dtype:
            raise InvalidArgument(f"{what} has dtype {name}; this namespace holds {layout.dtype} "
                                  "(convert with .to(...) first: the store never converts)")
        x = x.detach().view({2: t.int16, 4: t.int32}[isz])
        return x.numpy() if x.device.type == "cpu" else x
    if not isinstance(x, np.ndarray):
        raise InvalidArgument(f"{what} must be a numpy array or a torch tensor, got "
                              f"{type(x).__name__}")
    ok = x.dtype.name == layout.dtype or (x.dtype.kind in "ui" and x.dtype.itemsize == isz) \
        or (layout.dtype != "bfloat16" and x.dtype == _NP_DTYPES[layout.dtype])
    if not ok:
        hint = " (numpy has no bfloat16: pass a torch tensor or a uint16 view of the bits)" \
            if layout.dtype == "bfloat16" else ""
        raise InvalidArgument(f"{what} has dtype {x.dtype}; this namespace holds "
                              f"{layout.dtype}{hint}")
    return x.view(_RAW[isz])


def check_seq(x: Any, layout: KVLayout, tokens: int, what: str) -> None:
    """`x` must be [num_layers, 2, >= tokens, num_kv_heads, head_dim]."""
    shape = tuple(x.shape)
    L, _, T, H, D = layout.block_shape
    if len(shape) != 5 or shape[0] != L or shape[1] != 2 or shape[3] != H or shape[4] != D:
        raise InvalidArgument(f"{what} has shape {shape}; expected [num_layers={L}, 2, tokens, "
                              f"num_kv_heads={H}, head_dim={D}] (the canonical sequence layout)")
    if shape[2] < tokens:
        raise InvalidArgument(f"{what} holds {shape[2]} tokens, fewer than the {tokens} the "
                              "full blocks of token_ids need")


def slot_view(base: np.ndarray, offset: int, layout: KVLayout, like: Any) -> Any:
    """The block at `base[offset:]` as [L, 2, T, H, D] integers matching `like`'s kind."""
    nbytes = layout.block_bytes
    v = base[offset:offset + nbytes].view(_RAW[layout.itemsize]).reshape(layout.block_shape)
    if isinstance(like, np.ndarray):
        return v
    return _torch().from_numpy(v)


def copy_block(dst: Any, src: Any) -> None:
    """dst[...] = src for two same-shape integer views (numpy, or torch where one is a tensor)."""
    if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
        np.copyto(dst, src, casting="no")
        return
    t = _torch()
    d = t.from_numpy(dst) if isinstance(dst, np.ndarray) else dst
    s = t.from_numpy(src) if isinstance(src, np.ndarray) else src
    d.copy_(s)


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned, pre-faulted uint8 buffer (docs/performance.md: alignment, page faults)."""
    mm = mmap.mmap(-1, max(PAGE, nbytes))
    arr = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
    arr[::PAGE] = 0
    return arr


class StagingBuffers:
    """Staging buffers that each call checks out for itself and gives back when done.

    Why: the Client is thread-safe, and a staged store is read lazily (a Put stream's sender
    thread encodes the staged blocks while the RPC runs), so one buffer shared by the calls of
    a Namespace or PagedKV let one thread's fill overwrite blocks another was still sending:
    wrong bytes stored under valid keys. A buffer is never in two calls at once; `keep` of
    them wait for reuse, so a single-threaded engine allocates and page-faults once, not per
    call.
    """

    def __init__(self, keep: int = 2) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._keep = keep

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least `nbytes` that no other call holds until `give` returns it."""
        with self._lock:
            fits = [b for b in self._free if b.nbytes >= nbytes]
            if fits:
                buf = min(fits, key=lambda b: b.nbytes)
                self._free = [b for b in self._free if b is not buf]
                return buf
        return aligned_buffer(nbytes)

    def give(self, buf: np.ndarray) -> None:
        """Return a buffer no reader can still reach (the largest `keep` are kept)."""
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: b.nbytes, reverse=True)
            del self._free[self._keep:]
