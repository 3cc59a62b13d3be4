"""Store and load kvstore blocks straight from an engine's paged KV cache, given a block table.

Paged engines (vLLM, SGLang, TensorRT-LLM) keep KV in fixed-size pages: per layer a tensor such
as `[2, num_pages, page_tokens, heads, head_dim]` (K/V first) or `[num_pages, 2, page_tokens,
heads, head_dim]` (page first), and a block table saying which page holds block i of a sequence.
With `page_tokens == block_tokens`, kvstore block i is exactly page `block_table[i]` of every
layer, so no dense sequence copy is needed: this module moves pages between the engine's tensors
and the kvstore slots directly.

Host-memory caches (numpy or CPU tensors) go through `blockcopy`'s one-pass kernel: every
(layer, K/V) row of every page of a batch is copied and checksummed in one GIL-free call per
thread (`blockcopy.paged_plan`). Where the kernel is unavailable, the numpy path below runs.

How the numpy copy is vectorized: in the canonical block layout the K (or V) rows of layer l
sit at a fixed offset inside every slot, `(2*l + kv) * row_bytes`. Viewing the destination buffer as
overlapping rows that start at every multiple of `g = gcd(row_bytes, slot offsets)` turns "page
p of layer l, K, goes to slot j" into one fancy-index assignment per layer and K/V over all
blocks (`rows[dst_idx] = pages[page_ids]`): 2 × num_layers numpy calls per batch, never a loop
over blocks or tokens. Device tensors (CUDA) are gathered with `index_select` on the device per
layer into a host staging buffer, then moved one block at a time.

Tensors are viewed as same-size integers (bf16 needs no numpy support, bytes move unchanged).
"""

from __future__ import annotations

from collections.abc import Sequence
from math import gcd
from typing import Any

import numpy as np

from . import blockcopy
from .buffers import StagingBuffers, _is_tensor, _torch, raw_view
from .common.errors import InvalidArgument
from .common.layout import KVLayout
from .namespace import Namespace

_INT = {8: np.int64, 4: np.int32, 2: np.int16, 1: np.uint8}


def _view_reshape(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """a.reshape(shape) as a view, or InvalidArgument: a silent copy would lose loaded data."""
    v = a.view()
    try:
        v.shape = shape
    except AttributeError:
        raise InvalidArgument("the paged cache's (page_tokens, heads, head_dim) axes must be "
                              "contiguous within a page; got strides "
                              f"{a.strides}") from None
    return v


def _widest(rows: np.ndarray, g: int) -> np.ndarray:
    """rows viewed as the widest integer whose size divides g and the row length."""
    row_bytes = rows.shape[-1] * rows.itemsize
    for e in (8, 4, 2, 1):
        if g % e == 0 and row_bytes % e == 0:
            try:
                return rows.view(_INT[e])
            except ValueError:
                continue
    return rows.view(np.uint8)


def _overlapping_rows(base: np.ndarray, row_bytes: int, g: int, e: int) -> np.ndarray:
    """base as rows of row_bytes starting every g bytes (rows overlap; numpy allows it)."""
    usable = base.nbytes - base.nbytes % e
    flat = base[:usable].view(_INT[e])
    nrows = (usable - row_bytes) // g + 1
    return np.lib.stride_tricks.as_strided(flat, shape=(nrows, row_bytes // e), strides=(g, e),
                                           writeable=True)


class PagedKV:
    """An engine's paged KV cache, bound to a namespace, for block-table stores and loads.

    layers: one tensor (numpy or torch, namespace dtype) per layer, each with a K/V axis of size
        2 at `kv_axis`, a page axis at `page_axis`, and (page_tokens, heads, head_dim) as the
        remaining axes in that order. A single tensor with a leading layer axis is accepted too
        (pass it as `layers`; `kv_axis`/`page_axis` then count without the layer axis).
    kv_axis, page_axis: 0 and 1 for vLLM's flash-attention layout [2, pages, T, H, D]; 1 and 0
        for [pages, 2, T, H, D].
    """

    def __init__(self, ns: Namespace | KVLayout, layers: Any, *, kv_axis: int = 0,
                 page_axis: int = 1, use_torch_gather: bool | None = None) -> None:
        # A bare KVLayout gives an unbound object: gather/scatter work, store/load need a ns.
        lay = ns if isinstance(ns, KVLayout) else ns.layout
        if not isinstance(layers, (list, tuple)):
            if getattr(layers, "ndim", 0) != 6:
                raise InvalidArgument("layers must be a list of per-layer tensors or one tensor "
                                      "[num_layers, ...5 axes...]")
            layers = [layers[i] for i in range(layers.shape[0])]
        if len(layers) != lay.num_layers:
            raise InvalidArgument(f"got {len(layers)} layer tensors; the namespace has "
                                  f"{lay.num_layers} layers")
        if {kv_axis, page_axis} & {2, 3, 4} or kv_axis == page_axis or min(kv_axis,
                                                                          page_axis) < 0:
            raise InvalidArgument("kv_axis and page_axis must be 0 and 1 (in either order): "
                                  "the (tokens, heads, head_dim) axes come last")
        self.ns = None if isinstance(ns, KVLayout) else ns
        self.layout = lay
        self.kv_axis, self.page_axis = kv_axis, page_axis
        T, H, D = lay.block_tokens, lay.num_kv_heads, lay.head_dim
        self._raw = [raw_view(x, lay, f"layers[{i}]") for i, x in enumerate(layers)]
        shapes = {tuple(x.shape) for x in self._raw}
        if len(shapes) != 1:
            raise InvalidArgument(f"layer tensors differ in shape: {sorted(shapes)}")
        shape = shapes.pop()
        if len(shape) != 5 or shape[kv_axis] != 2 or shape[2:] != (T, H, D):
            raise InvalidArgument(
                f"layer shape {shape} does not match kv_axis={kv_axis}, page_axis={page_axis} "
                f"with (page_tokens={T}, heads={H}, head_dim={D}); page_tokens must equal the "
                "namespace's block_tokens")
        self.num_pages = shape[page_axis]
        self.row_elems = T * H * D
        self.row_bytes = self.row_elems * lay.itemsize
        on_device = any(not isinstance(x, np.ndarray) for x in self._raw)
        self._torch_path = on_device if use_torch_gather is None else use_torch_gather
        if self._torch_path:
            t = _torch()
            self._tview = [(t.from_numpy(x) if isinstance(x, np.ndarray) else x)
                           .movedim((page_axis, kv_axis), (0, 1)) for x in self._raw]
            self._staging = StagingBuffers()     # one buffer per copy, never shared
        # Host-memory caches go through the one-pass copy kernel when it can address them.
        self._kplan = None
        if not self._torch_path and blockcopy.kernel_available():
            self._kplan = blockcopy.paged_plan(self._raw, kv_axis, page_axis)
        if not self._torch_path:
            # [pages, 2, T*H*D] per layer: K rows and V rows as views of the engine's memory.
            self._rows = []
            for x in self._raw:
                a = np.moveaxis(x, (page_axis, kv_axis), (0, 1))
                self._rows.append(_view_reshape(a, (self.num_pages, 2, self.row_elems)))

    # -- block table --------------------------------------------------------------------------
    def _pages(self, block_table: Any, n: int, what: str) -> np.ndarray:
        if _is_tensor(block_table):
            block_table = block_table.detach().cpu().numpy()
        bt = np.asarray(block_table)
        if bt.ndim != 1 or (bt.size and bt.dtype.kind not in "iu"):
            raise InvalidArgument(f"block_table must be a 1-D list of integer page ids, got "
                                  f"shape {bt.shape} dtype {bt.dtype}")
        if len(bt) < n:
            raise InvalidArgument(f"block_table has {len(bt)} pages for the {n} blocks to {what}")
        bt = bt[:n].astype(np.intp)
        if n and (bt.min() < 0 or bt.max() >= self.num_pages):
            raise InvalidArgument(f"block_table holds page ids outside [0, {self.num_pages})")
        return bt

    # -- numpy path ---------------------------------------------------------------------------
    def _row_index(self, base: np.ndarray, offsets: Sequence[int]) -> tuple[int, np.ndarray]:
        g = gcd(self.row_bytes, *[int(o) for o in offsets], PAGE_HINT)
        return g, np.asarray(offsets, dtype=np.intp)

    def _np_move(self, base: np.ndarray, offsets: Sequence[int], pages: np.ndarray,
                 to_slots: bool) -> None:
        if self._kplan is not None:
            threads = self.ns.client.copy_threads if self.ns is not None else \
                blockcopy.default_threads()
            blockcopy.run(self._kplan, base, pages, offsets, to_slots, None, threads)
            return
        g, offs = self._row_index(base, offsets)
        for layer, rows in enumerate(self._rows):
            for kv in (0, 1):
                src = _widest(rows[:, kv], g)
                e = src.itemsize
                dst = _overlapping_rows(base, self.row_bytes, g, e)
                idx = (offs + (2 * layer + kv) * self.row_bytes) // g
                if to_slots:
                    dst[idx] = src[pages]
                else:
                    src[pages] = dst[idx]

    # -- torch path (device tensors) -------------------------------------------------------
    def _stage(self, buf: np.ndarray, n: int) -> Any:
        """n canonical blocks of `buf` as a torch tensor [n, L, 2, T, H, D] (same memory)."""
        lay = self.layout
        return _torch().from_numpy(buf[:n * lay.block_bytes].view(self._raw_np_dtype())).view(
            (n,) + lay.block_shape)

    def _raw_np_dtype(self) -> Any:
        return _INT[self.layout.itemsize]

    def _torch_move(self, base: np.ndarray, offsets: Sequence[int], pages: np.ndarray,
                    to_slots: bool) -> None:
        t = _torch()
        n = len(offsets)
        bb = self.layout.block_bytes
        dt = self._raw_np_dtype()
        # This copy's own staging: two threads moving pages through one PagedKV must not
        # write each other's blocks (StagingBuffers). Both directions' torch copies are
        # synchronous (no non_blocking), so nothing reads it once this returns.
        buf = self._staging.take(n * bb)
        stage = self._stage(buf, n)
        if to_slots:
            for layer, v in enumerate(self._tview):
                idx = t.as_tensor(pages, device=v.device)
                stage[:, layer].copy_(v.index_select(0, idx))
            for j, off in enumerate(offsets):
                np.copyto(base[off:off + bb].view(dt), buf[j * bb:(j + 1) * bb].view(dt))
        else:
            for j, off in enumerate(offsets):
                np.copyto(buf[j * bb:(j + 1) * bb].view(dt), base[off:off + bb].view(dt))
            for layer, v in enumerate(self._tview):
                idx = t.as_tensor(pages, device=v.device)
                v.index_copy_(0, idx, stage[:, layer].to(v.device))
        self._staging.give(buf)

    def _move(self, base: np.ndarray, offsets: Sequence[int], pages: np.ndarray,
              to_slots: bool) -> None:
        if self._torch_path:
            self._torch_move(base, offsets, pages, to_slots)
        else:
            self._np_move(base, offsets, pages, to_slots)

    def gather(self, base: np.ndarray, offsets: Sequence[int], block_table: Any) -> None:
        """Write page block_table[j] of every layer as a canonical block at base[offsets[j]:]."""
        self._move(base, offsets, self._pages(block_table, len(offsets), "gather"), True)

    def scatter(self, base: np.ndarray, offsets: Sequence[int], block_table: Any) -> None:
        """Copy the canonical block at base[offsets[j]:] into page block_table[j]."""
        self._move(base, offsets, self._pages(block_table, len(offsets), "scatter"), False)

    def _ns(self) -> Namespace:
        if self.ns is None:
            raise InvalidArgument("this PagedKV was made from a bare layout; pass a Namespace "
                                  "to store or load")
        return self.ns

    # -- public -------------------------------------------------------------------------------
    def store_keys(self, keys: Sequence[bytes], block_table: Any, *,
                   parent: bytes | None = None, token_ids: Any = None) -> int:
        """Store pages block_table[i] as keys[i] (missing blocks only); returns blocks written.
        `token_ids`: as Namespace.store_keys (block i's at [i*T, (i+1)*T)), sent where the
        daemon publishes KV events, which announce only blocks whose token ids it knows."""
        keys = list(keys)
        pages = self._pages(block_table, len(keys), "store")
        ns = self._ns()
        if self._kplan is not None:
            return ns.store_blocks(keys, ns.fused_move(self._kplan, True, pages), parent=parent,
                                   token_ids=token_ids)

        def fill(base: np.ndarray, offsets: Sequence[int], first: int) -> None:
            self._move(base, offsets, pages[first:first + len(offsets)], True)
        return ns.store_blocks(keys, fill, parent=parent, token_ids=token_ids)

    def store(self, token_ids: Any, block_table: Any) -> int:
        """store_keys for the reference keys of the full blocks of token_ids (and their token
        ids, for KV events)."""
        return self.store_keys(self._ns().keys(token_ids), block_table, token_ids=token_ids)

    def load_keys(self, keys: Sequence[bytes], block_table: Any) -> int:
        """Load the cached prefix of keys into pages block_table[i]; returns blocks loaded.

        block_table may be shorter than keys: at most len(block_table) blocks are loaded.
        """
        keys = list(keys)
        n = min(len(keys), len(block_table))
        pages = self._pages(block_table, n, "load")
        ns = self._ns()
        if self._kplan is not None:
            return ns.load_blocks(keys[:n], ns.fused_move(self._kplan, False, pages))

        def drain(base: np.ndarray, offsets: Sequence[int], first: int) -> None:
            self._move(base, offsets, pages[first:first + len(offsets)], False)
        return ns.load_blocks(keys[:n], drain)

    def load(self, token_ids: Any, block_table: Any) -> int:
        """load_keys for token_ids; returns tokens loaded (a multiple of block_tokens)."""
        return self.load_keys(self._ns().keys(token_ids), block_table) * self.layout.block_tokens


# Slot offsets the daemon hands out are page-aligned; folding the page size into the gcd keeps
# rows on a coarse grid even when a batch holds a single slot.
PAGE_HINT = 4096
