"""GPU tier: one preallocated device slab per GPU, cut into block slots, shared over CUDA IPC.

Why a slab: clients open it once (`kvstore_client.gpu.open_pool(describe())`) and then copy
blocks at offsets the daemon hands out, with no per-block IPC handles, allocations or syscalls.
It mirrors `tiers/host.py`: the same `ExtentAllocator`, the same alloc/free/describe/close, so
the store treats both slab tiers alike.

Why these streams: demotion (GPU → host) and promotion (host → GPU) run on two daemon-owned
streams, so they overlap each other and never queue behind an engine's compute. Every batched
call returns at once with a `Transfer` (an event) or a `Future`; the store waits with a
deadline. Lossy demotion quantizes on the GPU (`tiers.codecs.encode_tensor`) so only the
half-size codes cross PCIe.

Without CUDA the constructor raises `Unavailable("... no CUDA device ...")`; `open_gpu_tiers`
turns that into one log line and no tier, so the daemon serves normally on CPU-only machines.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from kvstore_client.errors import InvalidArgument, KVStoreError, Unavailable
from kvstore_client.gpu import (
    PinnedHost,
    Transfer,
    coalesce_runs,
    cuda_available,
    pin_host,
    require_cuda,
)
from kvstore_client.layout import KVLayout

from .cuda_util import CudaError, DeviceSlab, device_identity
from .slab import ExtentAllocator, SlabAllocation

if TYPE_CHECKING:  # pragma: no cover
    import torch

PAGE = 4096
DEFAULT_WAIT_S = 30.0

Item = tuple[int, int, int]            # (gpu_offset, host_offset, nbytes)
EncodeFn = Callable[[str, Any, KVLayout], Any]   # (codec, device tensor, layout) -> payload


class GPUTier(SlabAllocation):
    """A `capacity`-byte device slab on `device`, cut into 4 KiB-aligned extents."""

    name = "gpu"

    def __init__(self, capacity: int, device: int = 0, *, slab_name: str = "") -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < PAGE:
            raise InvalidArgument(f"gpu.capacity must be at least {PAGE} bytes, got {capacity!r}")
        capacity -= capacity % PAGE
        torch = require_cuda(device, f"gpu tier (cuda:{device})")
        try:
            self._slab = DeviceSlab(capacity, device)
        except CudaError as e:
            raise Unavailable(f"gpu tier on cuda:{device}: {e}") from None
        self.capacity = capacity
        self.device = device
        self.slab_name = slab_name or f"gpu{device}"
        self._ident = device_identity(device)
        self._alloc = ExtentAllocator(capacity, PAGE)
        self._d2h = torch.cuda.Stream(device=device)     # demotion
        self._h2d = torch.cuda.Stream(device=device)     # promotion
        self._pinned: list[PinnedHost] = []
        self._worker: cf.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    # -- access --------------------------------------------------------------------------------
    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """1-D uint8 CUDA tensor over slab bytes [offset, offset+nbytes), zero copy."""
        self._check_range(offset, nbytes)
        return self._slab.tensor[offset:offset + nbytes]

    def describe(self) -> dict:
        """What a client needs: `kvstore_client.gpu.open_pool(describe())`."""
        self._require_open()
        d = {"kind": "cuda_ipc", "device": self.device, "handle": self._slab.handle,
             "size": self.capacity, "pid": os.getpid(), "name": self.slab_name}
        for key in ("uuid", "model"):
            if key in self._ident:
                d[key] = self._ident[key]
        return d

    def pin_host(self, array: np.ndarray) -> PinnedHost:
        """Register a host buffer (the host tier's shm slab) as pinned, for PCIe-speed copies.

        The registration is dropped by `close()`; the buffer must stay mapped until then.
        """
        p = pin_host(array)
        self._pinned.append(p)
        return p

    # -- host <-> GPU copies ---------------------------------------------------------------------
    def copy_to_host(self, offset: int, nbytes: int, host_view: np.ndarray,
                     timeout_s: float = DEFAULT_WAIT_S) -> None:
        """Copy slab bytes into `host_view` (1-D uint8, ≥ nbytes) and wait for it."""
        self.copy_to_host_batch([(offset, 0, nbytes)], host_view).wait(timeout_s)

    def copy_from_host(self, offset: int, nbytes: int, host_view: np.ndarray,
                       timeout_s: float = DEFAULT_WAIT_S) -> None:
        """Copy `host_view[:nbytes]` into the slab at `offset` and wait for it."""
        self.copy_from_host_batch([(offset, 0, nbytes)], host_view).wait(timeout_s)

    def copy_to_host_batch(self, items: Sequence[Item], host: np.ndarray,
                           after: Any = None) -> Transfer:
        """Demotion: enqueue GPU → host copies of (gpu_offset, host_offset, nbytes) on the d2h
        stream after `after` (Transfer, CUDA event or Future); returns at once."""
        return self._enqueue(items, host, after, to_host=True)

    def copy_from_host_batch(self, items: Sequence[Item], host: np.ndarray,
                             after: Any = None) -> Transfer:
        """Promotion: enqueue host → GPU copies on the h2d stream; returns at once."""
        return self._enqueue(items, host, after, to_host=False)

    def encode_batch(self, items: Sequence[tuple[int, int]], codec: str, layout: KVLayout,
                     after: Any = None, encode_fn: EncodeFn | None = None
                     ) -> cf.Future[list[bytes]]:
        """Encode blocks at (gpu_offset, nbytes) with `codec` for a keyed tier (ssd, remote).

        Lossy codecs quantize on this GPU, on the d2h stream, so only codes and scales cross
        PCIe. Runs on a daemon worker thread; the Future yields one payload per item, in order.
        """
        for off, nb in items:
            self._check_range(off, nb)
            if nb != layout.block_bytes:
                raise InvalidArgument(f"block at gpu offset {off} is {nb} bytes; the layout "
                                      f"needs {layout.block_bytes}")
        fn = encode_fn or _default_encoder()
        dtype_name = layout.dtype
        items = [(int(o), int(n)) for o, n in items]

        def work() -> list[bytes]:
            import torch

            _wait_after_host(after)
            dtype = getattr(torch, dtype_name)
            out: list[bytes] = []
            with torch.cuda.device(self.device), torch.cuda.stream(self._d2h):
                _stream_wait(self._d2h, after)
                for off, nb in items:
                    block = self._slab.tensor[off:off + nb].view(dtype)
                    out.append(bytes(fn(codec, block, layout)))
            return out

        return self._executor().submit(work)

    # -- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        """Drain streams, unpin host buffers, free the slab. Idempotent."""
        with self._lock:
            if self._slab.closed:
                return
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True)
        try:
            self._d2h.synchronize()
            self._h2d.synchronize()
        finally:
            for p in self._pinned:
                try:
                    p.close()
                except KVStoreError:
                    pass
            self._pinned.clear()
            self._slab.close()

    @property
    def closed(self) -> bool:
        return self._slab.closed

    def __enter__(self) -> GPUTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------------
    def _require_open(self) -> torch.Tensor:
        if self._slab.closed:
            raise InvalidArgument("gpu tier is closed")
        return self._slab.tensor

    def _check_range(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.capacity:
            raise InvalidArgument(f"gpu slab range [{offset}, {offset + nbytes}) is outside the "
                                  f"{self.capacity}-byte slab")

    def _executor(self) -> cf.ThreadPoolExecutor:
        with self._lock:
            if self._worker is None:
                self._worker = cf.ThreadPoolExecutor(
                    1, thread_name_prefix=f"kvstore-gpu{self.device}")
            return self._worker

    def _enqueue(self, items: Sequence[Item], host: np.ndarray, after: Any,
                 to_host: bool) -> Transfer:
        import torch

        gt = self._require_open()
        if not isinstance(host, np.ndarray) or host.dtype != np.uint8 or host.ndim != 1 \
                or not host.flags.c_contiguous:
            raise InvalidArgument("host buffer must be a 1-D contiguous uint8 numpy array")
        if to_host and not host.flags.writeable:
            raise InvalidArgument("host buffer for a GPU → host copy must be writable")
        arr = np.asarray(items, dtype=np.int64).reshape(-1, 3)
        g, h, n = arr[:, 0], arr[:, 1], arr[:, 2]
        if arr.size and ((g < 0).any() or (h < 0).any() or (n <= 0).any()
                         or (g + n > self.capacity).any() or (h + n > host.size).any()):
            raise InvalidArgument("a copy range lies outside the gpu slab or the host buffer")
        g, h, n = coalesce_runs(g, h, n)
        stream = self._d2h if to_host else self._h2d
        _wait_after_host(after)
        ht = torch.from_numpy(host)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            _stream_wait(stream, after)
            # one copy per coalesced run: runs are whole blocks (≥ 256 KiB) or larger
            for go, ho, nb in zip(g.tolist(), h.tolist(), n.tolist(), strict=True):
                if to_host:
                    ht[ho:ho + nb].copy_(gt[go:go + nb], non_blocking=True)
                else:
                    gt[go:go + nb].copy_(ht[ho:ho + nb], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        return Transfer(ev, keepalive=(ht, host), method="memcpy", nbytes=int(n.sum()))


def _default_encoder() -> EncodeFn:
    from .codecs import encode_tensor  # torch-heavy: import on first use

    return encode_tensor


def _stream_wait(stream: Any, after: Any) -> None:
    """GPU-side part of `after`: the stream waits for a Transfer's or a torch.cuda.Event."""
    if isinstance(after, Transfer):
        after.wait_stream(stream)
    elif after is not None and hasattr(after, "query") and hasattr(after, "record"):
        stream.wait_event(after)


def _wait_after_host(after: Any, timeout_s: float = DEFAULT_WAIT_S) -> None:
    """Host-side part of `after`: a Future (e.g. a CPU decode) must finish first."""
    if isinstance(after, cf.Future):
        after.result(timeout=timeout_s)


def open_gpu_tiers(capacity: int, devices: Sequence[int], log: logging.Logger | None = None,
                   slab_prefix: str = "") -> dict[int, GPUTier]:
    """The daemon's GPU tiers, one per device; without CUDA: {} and one log line."""
    log = log or logging.getLogger("kvstore")
    if not cuda_available():
        log.warning("gpu tier disabled: no CUDA device on this machine (torch.cuda is "
                    "unavailable); serving from host/ssd only")
        return {}
    tiers: dict[int, GPUTier] = {}
    for dev in devices:
        try:
            tiers[dev] = GPUTier(capacity, dev, slab_name=f"{slab_prefix}gpu{dev}")
        except KVStoreError as e:      # Unavailable, or ResourceExhausted: slab does not fit
            log.warning("gpu tier on cuda:%s disabled: %s", dev, e)
    return tiers
