"""Where one page lies in SGLang's host KV pool, and the copies between it and a pool slot.

A stored block is exactly SGLang's flat data page (`host_pool.get_data_page(i, flat=True)`):
the page's view of the pool buffer, in the view's own element order. So pages written through
the zero-copy v1 calls and through the older `set(key, flat_page)` calls are the same bytes,
and a page is copied with one strided copy from the pool straight into the daemon's
shared-memory slot (or back), never through a temporary.

Layouts: the pool's `layout` ("layer_first", "page_first", "page_first_direct", "page_head")
names the page's element order; it is part of the namespace, so pools of different layouts
never read each other's pages. Where the order is known (SGLang's plain MHA pool), `kv_axes`
declares it (lossy codecs may then apply); every other pool (MLA, K-only, custom) is stored as
opaque bytes.

A pool without `get_data_page` that offers SGLang's zero-copy interface instead
(`get_page_buffer_meta`: per page, runs of pointer and size in its `kv_buffer`, what zero-copy
backends such as Mooncake read) is addressed through that (`MetaPages`): a stored page is its
runs in order, in a namespace of its own (":meta").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# torch dtype name -> kvstore dtype name (the namespace records it; fp8 stays opaque bytes)
_DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32",
           "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}
# The element order of an MHA page view [2 (K,V), ...] per layout, in kvstore's axis letters
# (L layers, 2 K/V, T tokens, H heads, D head_dim); memory_pool_host's get_data_page.
_MHA_AXES = {"layer_first": "2LTHD", "page_first": "2TLHD",
             "page_first_direct": "2LTHD", "page_head": "2HTLD"}


@dataclass(frozen=True)
class PageGeometry:
    """What the backend knows of one host-pool page."""

    pool: str            # the host pool's class name
    layout: str          # the pool's layout name
    page_size: int       # tokens per page
    shape: tuple[int, ...]   # the page view's shape
    dtype: str           # kvstore dtype name ("uint8" when kvstore has no name for it)
    torch_dtype: Any
    nbytes: int          # bytes of one page (one stored block)
    format_tag: str      # the pool's own page-format tag, if it has one
    addressing: str = "page"     # "page": get_data_page views; "meta": get_page_buffer_meta runs

    @property
    def engine_layout(self) -> str:
        dims = "x".join(map(str, self.shape))
        tag = f":{self.format_tag}" if self.format_tag else ""
        meta = ":meta" if self.addressing == "meta" else ""
        return (f"sglang-hicache:{self.pool}:{self.layout}:p{self.page_size}:{dims}:"
                f"{self.dtype}{tag}{meta}")

    def declared_axes(self) -> tuple[str, dict[str, int]] | None:
        """(kv_axes, sizes) when the page's KV order is certain, else None (opaque bytes).

        Only SGLang's plain MHA pool qualifies: its subclasses (asymmetric K/V widths, MXFP8
        scales, sparse) lay pages out otherwise.
        """
        axes = _MHA_AXES.get(self.layout)
        if axes is None or self.pool != "MHATokenToKVPoolHost" or self.addressing != "page" \
                or self.dtype not in ("float16", "bfloat16", "float32"):
            return None
        shape = list(self.shape)
        if self.layout in ("page_first_direct", "page_head"):
            shape = [shape[0], *shape[2:]]          # drop the one-page axis
        if len(shape) != 5 or shape[0] != 2:
            return None
        sizes = dict(zip(axes, shape, strict=True))
        if sizes["T"] != self.page_size:
            return None
        return axes, sizes


def geometry(host_pool: Any) -> PageGeometry:
    """The page geometry of a registered SGLang host pool (HostKVCache)."""
    if not hasattr(host_pool, "get_data_page") and hasattr(host_pool, "get_page_buffer_meta"):
        return MetaPages(host_pool).geometry()
    view = host_pool.get_data_page(0, flat=False)
    tdtype = view.dtype
    name = str(tdtype).removeprefix("torch.")
    return PageGeometry(pool=type(host_pool).__name__, layout=str(host_pool.layout),
                        page_size=int(host_pool.page_size), shape=tuple(view.shape),
                        dtype=_DTYPES.get(name, "uint8"), torch_dtype=tdtype,
                        nbytes=view.numel() * view.element_size(),
                        format_tag=str(getattr(host_pool, "storage_format_tag", "") or ""))


def page_starts(host_indices: Any, pages: int, page_size: int) -> list[int] | None:
    """The host-pool token index each page starts at; None when host_indices does not hold
    exactly `pages` pages."""
    n = int(host_indices.numel()) if hasattr(host_indices, "numel") else len(host_indices)
    if n != pages * page_size:
        return None
    return [int(i) for i in host_indices[::page_size].tolist()] if pages else []


def words(t: Any) -> np.ndarray:
    """A numpy view of a CPU tensor (page view) in the widest integer word its rows divide
    into, sharing its memory.

    Copies go through numpy, not torch: torch splits a copy over its intra-op threads, and on a
    busy machine those threads wait on each other (strided copies ran 100x slower with 2
    threads on 2 loaded cores, docs/performance.md); numpy copies on the calling thread.
    Wider words copy faster.
    """
    import torch
    b = t if t.dtype == torch.uint8 else t.view(torch.uint8)
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if b.shape[-1] % size == 0 and b.data_ptr() % size == 0:
            try:
                return _rows(b.view(dt).numpy())
            except RuntimeError:
                continue
    return _rows(b.numpy())


def _rows(a: np.ndarray) -> np.ndarray:
    """The same memory with its contiguous trailing axes merged into one (numpy copies a
    [16, 4096]-word view at memcpy speed, a [2, 8, 32, 4, 16] one at a third of it)."""
    j, run = a.ndim, a.itemsize
    while j > 0 and (a.shape[j - 1] == 1 or a.strides[j - 1] == run):
        run *= a.shape[j - 1]
        j -= 1
    if a.ndim - j < 2:
        return a
    v = a.view()
    try:
        v.shape = (*a.shape[:j], run // a.itemsize)   # raises rather than copy
    except AttributeError:
        return a
    return v


def slot_words(base: np.ndarray, offset: int, like: np.ndarray) -> np.ndarray:
    """The pool slot at `offset` as an array of `like`'s word type and shape."""
    return base[offset:offset + like.nbytes].view(like.dtype).reshape(like.shape)


def flat_words(t: Any, geo: PageGeometry) -> np.ndarray:
    """A flat page tensor (the non-v1 calls' values) as words in the page's shape."""
    if t.numel() * t.element_size() != geo.nbytes:
        raise ValueError(f"a page tensor of {t.numel() * t.element_size()} bytes, expected "
                         f"{geo.nbytes}")
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("a flat page tensor must be a contiguous CPU tensor")
    return words(t.reshape(-1).view(geo.torch_dtype).view(geo.shape))


class PageViews:
    """Word views (`words`) of the pool's pages by start token index, without torch per page.

    A page's view starts a fixed number of bytes after the previous page's in every layout
    SGLang's pools use, so after checking that on the first, second and last pages against
    `get_data_page`, a page's view is one numpy constructor (~2 us) instead of a torch slice,
    dtype views and a numpy conversion (~25 us). Anything else uses `get_data_page` per page.
    """

    def __init__(self, host_pool: Any) -> None:
        self.pool = host_pool
        self.page_size = int(host_pool.page_size)
        self._fast: tuple | None = None
        try:
            self._fast = self._derive()
        except Exception:
            self._fast = None

    def _slow(self, start: int) -> np.ndarray:
        return words(self.pool.get_data_page(start, flat=False))

    def _derive(self) -> tuple | None:
        import torch
        buf, P = getattr(self.pool, "kv_buffer", None), self.page_size
        size = int(getattr(self.pool, "size", 0) or 0)
        if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu" \
                or not buf.is_contiguous() or size < 2 * P:
            return None
        raw = buf.view(torch.uint8).reshape(-1).numpy()
        v0, v1 = self._slow(0), self._slow(P)
        step = v1.ctypes.data - v0.ctypes.data
        if v1.shape != v0.shape or v1.strides != v0.strides or step <= 0:
            return None
        fast = (raw, v0.ctypes.data - raw.ctypes.data, step, v0.shape, v0.strides, v0.dtype)
        self._fast = fast
        last = (size // P - 1) * P
        want = self._slow(last)
        got = self.view(last)
        if got.ctypes.data != want.ctypes.data or got.strides != want.strides:
            return None
        return fast

    def kernel_plan(self) -> Any:
        """A blockcopy plan (SDK kernel: copy and checksum in one parallel pass) addressing
        page j (start token j * page_size) as block j; None where the fast views do not apply.

        A page's rows are its view's leading index combinations in C order, each a contiguous
        run of the merged trailing axes, which is the flat page's byte order.
        """
        if self._fast is None:
            return None
        from ..blockcopy import Plan
        raw, off0, step, shape, strides, dt = self._fast
        lead, lead_strides = shape[:-1], strides[:-1]
        rows = np.zeros(1, dtype=np.int64)
        for n, st in zip(lead, lead_strides, strict=True):
            rows = (rows[:, None] + np.arange(n, dtype=np.int64)[None, :] * st).reshape(-1)
        pages = (raw.nbytes - off0) // step
        if pages <= 0 or strides[-1] != np.dtype(dt).itemsize:
            return None
        blk = off0 + np.arange(pages, dtype=np.int64) * step
        return Plan([raw], raw.ctypes.data, blk, rows, shape[-1] * np.dtype(dt).itemsize)

    def view(self, start: int) -> np.ndarray:
        """The page starting at token index `start` (a multiple of the page size)."""
        if self._fast is None or start % self.page_size:
            return self._slow(start)
        raw, off0, step, shape, strides, dt = self._fast
        return np.ndarray(shape, dt, buffer=raw, offset=off0 + start // self.page_size * step,
                          strides=strides)


class MetaPages:
    """A pool's pages through SGLang's zero-copy interface: `get_page_buffer_meta(indices)` lists,
    for each page, runs of (pointer, bytes) inside the pool's `kv_buffer`. Every run is checked
    to lie inside that buffer before a byte is copied."""

    def __init__(self, host_pool: Any) -> None:
        import torch
        buf = getattr(host_pool, "kv_buffer", None)
        if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu" \
                or not buf.is_contiguous():
            raise ValueError("its kv_buffer is not one contiguous CPU tensor")
        self.pool = host_pool
        self.page_size = int(host_pool.page_size)
        self.torch_dtype = buf.dtype
        self.raw = buf.view(torch.uint8).reshape(-1).numpy()
        self._base = self.raw.ctypes.data
        first = self.runs(0)
        self.sizes = [n for _, n in first]

    def runs(self, start: int) -> list[tuple[int, int]]:
        """(offset into kv_buffer, bytes) of each run of the page starting at token `start`."""
        import torch
        ptrs, sizes = self.pool.get_page_buffer_meta(
            torch.arange(start, start + self.page_size, dtype=torch.int64))
        out = []
        for p, n in zip(ptrs, sizes, strict=True):
            off, n = int(p) - self._base, int(n)
            if n <= 0 or off < 0 or off + n > self.raw.nbytes:
                raise ValueError(f"page {start}: a run of {n} bytes at {int(p):#x} is outside "
                                 "the pool's buffer")
            out.append((off, n))
        if hasattr(self, "sizes") and [n for _, n in out] != self.sizes:
            raise ValueError(f"page {start} has runs of {[n for _, n in out]} bytes, page 0 "
                             f"of {self.sizes}")
        return out

    def geometry(self) -> PageGeometry:
        nbytes = sum(self.sizes)
        item = self.torch_dtype.itemsize
        uniform = len(set(self.sizes)) == 1 and self.sizes[0] % item == 0
        shape = (len(self.sizes), self.sizes[0] // item) if uniform else (nbytes // item,)
        name = str(self.torch_dtype).removeprefix("torch.")
        return PageGeometry(pool=type(self.pool).__name__, layout=str(self.pool.layout),
                            page_size=self.page_size, shape=shape,
                            dtype=_DTYPES.get(name, "uint8"), torch_dtype=self.torch_dtype,
                            nbytes=nbytes,
                            format_tag=str(getattr(self.pool, "storage_format_tag", "") or ""),
                            addressing="meta")

    def copy(self, start: int, slot: np.ndarray, to_slot: bool) -> None:
        """Copy the page at token `start` into `slot` (its bytes, uint8), or back."""
        pos = 0
        for off, n in self.runs(start):
            if to_slot:
                slot[pos:pos + n] = self.raw[off:off + n]
            else:
                self.raw[off:off + n] = slot[pos:pos + n]
            pos += n


def views_for(host_pool: Any, geo: PageGeometry) -> PageViews | MetaPages:
    """How the backend reaches the pool's pages, as its geometry says."""
    return MetaPages(host_pool) if geo.addressing == "meta" else PageViews(host_pool)
