"""CUDA implementation of the device interface (tiers/device.py): one preallocated device slab
per GPU, cut into block slots, shared over CUDA IPC.

Why a slab: clients open it once (`kvstore_client.gpu.open_pool(describe())`) and then copy
blocks at offsets the daemon hands out, with no per-block IPC handles, allocations or syscalls.
It mirrors `tiers/host.py` and `tiers/device_cpu.py`: the same `ExtentAllocator`, the same
alloc/free/describe/close, so the store treats every slab tier alike. Nothing here decides
anything the CPU device does not decide the same way: placement, eviction and verification
live in the store (kvstore/gpu_slots.py, kvstore/moves/gpu_host.py), planning in the SDK.

Why these streams: demotion (GPU → host) and promotion (host → GPU) run on two daemon-owned
streams, so they overlap each other and never queue behind an engine's compute. Every batched
call returns at once with a `Transfer` (an event) or a `Future`; the store waits with a
deadline. Lossy demotion quantizes on the GPU (`tiers.codecs.encode_tensor`) so only the
half-size codes cross PCIe.

Without CUDA the constructor raises `Unavailable("... no CUDA device ...")`;
`tiers.device.open_device_tiers` then picks the CPU device (or, with gpu.backend=cuda, no tier).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from kvstore_client.common.cuda_runtime import get_runtime, require_cuda
from kvstore_client.common.errors import InvalidArgument, KVStoreError, Unavailable
from kvstore_client.common.layout import KVLayout
from kvstore_client.common.pinning import PinnedHost, pin_host
from kvstore_client.common.transfer import Transfer

from .cuda_util import CudaError, DeviceSlab, device_identity
from .device import DEFAULT_WAIT_S, PAGE, DeviceTier, Item, check_host
from .slab import ExtentAllocator

if TYPE_CHECKING:  # pragma: no cover
    import torch

EncodeFn = Callable[[str, Any, KVLayout], Any]   # (codec, device tensor, layout) -> payload


class GPUTier(DeviceTier):
    """A `capacity`-byte device slab on `device`, cut into 4 KiB-aligned extents."""

    kind = "cuda"

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
    def copy_to_host_batch(self, items: Sequence[Item], host: np.ndarray,
                           after: Any = None) -> Transfer:
        """Demotion: enqueue GPU → host copies of (gpu_offset, host_offset, nbytes) on the d2h
        stream after `after` (Transfer, CUDA event or Future); returns at once."""
        return self._enqueue(items, host, after, to_host=True)

    def copy_from_host_batch(self, items: Sequence[Item], host: np.ndarray,
                             after: Any = None) -> Transfer:
        """Promotion: enqueue host → GPU copies on the h2d stream; returns at once."""
        return self._enqueue(items, host, after, to_host=False)

    def gather(self, items: Sequence[Item], dst: DeviceTier | None = None) -> Transfer:
        """Device -> device on the d2h stream: within this slab or into another GPU tier
        (peer copy)."""
        import torch

        target = self if dst is None else dst
        if not isinstance(target, GPUTier):
            raise InvalidArgument("a CUDA device can gather only into another CUDA device")
        s, d, n = self._plan(items, target.capacity, "destination slab")
        src, out = self._require_open(), target._require_open()
        with torch.cuda.device(self.device), torch.cuda.stream(self._d2h):
            for so, do, nb in zip(s.tolist(), d.tolist(), n.tolist(), strict=True):
                out[do:do + nb].copy_(src[so:so + nb], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._d2h)
        return Transfer(ev, keepalive=(src, out), method="memcpy", nbytes=int(n.sum()))

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

    # -- internals -------------------------------------------------------------------------------
    def _require_open(self) -> torch.Tensor:
        if self._slab.closed:
            raise InvalidArgument("gpu tier is closed")
        return self._slab.tensor

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
        check_host(host, to_host)
        g, h, n = self._plan(items, host.size, "host buffer")
        stream = self._d2h if to_host else self._h2d
        _wait_after_host(after)
        rt = get_runtime()
        dev_base, host_base, raw = gt.data_ptr(), host.ctypes.data, stream.cuda_stream
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            _stream_wait(stream, after)
            rt.use_device(self.device)
            # One cudaMemcpyAsync per coalesced run (whole blocks, >= 256 KiB, or longer),
            # issued raw: torch's copy_ of two slices cost as long as a 2 MiB block takes to
            # cross PCIe on a slow host, which left the copy engine waiting for the next call.
            for go, ho, nb in zip(g.tolist(), h.tolist(), n.tolist(), strict=True):
                if to_host:
                    rt.memcpy_async(host_base + ho, dev_base + go, nb, raw)
                else:
                    rt.memcpy_async(dev_base + go, host_base + ho, nb, raw)
            ev = torch.cuda.Event()
            ev.record(stream)
        return Transfer(ev, keepalive=(gt, host), method="memcpy", nbytes=int(n.sum()))


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
