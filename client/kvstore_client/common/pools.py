"""Device pools a client opens once by handle: CUDA IPC slabs and CPU-device shm slabs.

Why pools are cached per handle: CUDA refuses to open the same IPC handle twice in a context
and refuses to open a process's own handle, so `open_pool` maps each handle once per process
and serves the exporting process (an in-process daemon) its own pointer. The CPU device
(`tiers/device_cpu.py`) exports a shared-memory segment instead of an IPC handle; it opens
through the same `open_pool` into a `CpuPool` with the same `.ptr`, `.size`, `.device` (None)
and `.close()`, so `PagedCopier` and the SDK treat both alike.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .cuda_runtime import IPC_HANDLE_BYTES, device_tensor, get_runtime, require_cuda
from .errors import InvalidArgument

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

CPU_POOL_KIND = "cpu_shm"
CPU_MEMFD_KIND = "cpu_memfd"    # a tenant's own CPU-device slab: an fd from the handshake
CUDA_POOL_KIND = "cuda_ipc"


def host_tensor(ptr: int, nbytes: int, owner: object = None) -> torch.Tensor:
    """1-D uint8 CPU tensor over raw host memory (used for CPU execution of the same plans)."""
    import torch

    arr = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=np.uint8)
    t = torch.from_numpy(arr)
    t._kvstore_owner = owner  # type: ignore[attr-defined]
    return t


# ---------------------------------------------------------------------------------------------
# pools: one IPC mapping per handle per process
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolDesc:
    """What `GPUTier.describe()` tells a client (validated)."""

    device: int
    handle: bytes
    size: int
    pid: int
    uuid: str = ""
    name: str = ""

    @classmethod
    def parse(cls, d: dict) -> PoolDesc:
        if not isinstance(d, dict) or d.get("kind") != "cuda_ipc":
            raise InvalidArgument(f"not a CUDA IPC pool description: {d!r:.200}")
        handle = d.get("handle")
        if isinstance(handle, str):  # JSON transports carry it as hex
            try:
                handle = bytes.fromhex(handle)
            except ValueError:
                raise InvalidArgument("pool handle is not hex") from None
        if isinstance(handle, (bytearray, memoryview)):
            handle = bytes(handle)
        if not isinstance(handle, bytes) or len(handle) != IPC_HANDLE_BYTES:
            raise InvalidArgument(f"pool handle must be {IPC_HANDLE_BYTES} bytes "
                                  f"(cudaIpcMemHandle_t), got {type(handle).__name__} "
                                  f"of length {len(handle) if hasattr(handle, '__len__') else '?'}")
        for key in ("device", "size", "pid"):
            v = d.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (key == "size" and v == 0):
                raise InvalidArgument(f"pool {key} must be a non-negative integer, got {v!r}")
        return cls(d["device"], handle, d["size"], d["pid"], str(d.get("uuid", "")),
                   str(d.get("name", "")))


class DevicePool:
    """A daemon GPU pool mapped into this process. Use `open_pool`, not the constructor."""

    def __init__(self, desc: PoolDesc, ptr: int, device: int, local: bool) -> None:
        self.desc = desc
        self.ptr = ptr
        self.size = desc.size
        self.device = device          # the device index *in this process*
        self.local = local            # True: this process exported it; nothing to close
        self._tensor: torch.Tensor | None = None
        self.closed = False

    @property
    def tensor(self) -> torch.Tensor:
        """The whole pool as a 1-D uint8 CUDA tensor (zero copy)."""
        if self.closed:
            raise InvalidArgument("GPU pool mapping is closed")
        if self._tensor is None:
            self._tensor = device_tensor(self.ptr, self.size, self.device, self)
        return self._tensor

    def close(self) -> None:
        """Unmap (cudaIpcCloseMemHandle) after every stream on the device has drained."""
        if self.closed:
            return
        self.closed = True
        self._tensor = None
        with _pools_lock:
            if _pools.get(self.desc.handle) is self:
                del _pools[self.desc.handle]
        if self.local or _pools_pid != os.getpid():
            return   # own export, or a forked child that never had this mapping
        torch = require_cuda(self.device, "close GPU pool")
        torch.cuda.synchronize(self.device)   # no kernel may still read the mapping
        get_runtime().ipc_close_mem_handle(self.device, self.ptr)


_pools: dict[bytes, Any] = {}
_pools_pid = os.getpid()
_pools_lock = threading.Lock()
# handle -> (ptr, device) of pools this process exported itself (an in-process daemon).
_local_exports: dict[bytes, tuple[int, int]] = {}


def register_local_export(handle: bytes, ptr: int, device: int) -> None:
    """Called by the daemon's GPU tier: CUDA cannot open a process's own IPC handle."""
    with _pools_lock:
        _local_exports[bytes(handle)] = (ptr, device)


def unregister_local_export(handle: bytes) -> None:
    with _pools_lock:
        _local_exports.pop(bytes(handle), None)
        pool = _pools.pop(bytes(handle), None)
    if pool is not None:
        pool.closed = True


def _local_device_for(desc: PoolDesc, torch: Any) -> int | None:
    """The index of the pool's physical GPU in this process (CUDA_VISIBLE_DEVICES may differ)."""
    if not desc.uuid:
        return None
    for i in range(torch.cuda.device_count()):
        try:
            if str(torch.cuda.get_device_properties(i).uuid) == desc.uuid:
                return i
        except (AttributeError, RuntimeError):
            return None
    return None


@dataclass(frozen=True)
class CpuPoolDesc:
    """What the CPU device's `describe()` tells a client (validated): a shm segment name, or
    (a tenant's own slab, kind cpu_memfd) the fd the handshake handed over."""

    device: int
    name: str
    size: int
    pid: int
    fd: int | None = None

    @classmethod
    def parse(cls, d: dict) -> CpuPoolDesc:
        if not isinstance(d, dict) or d.get("kind") not in (CPU_POOL_KIND, CPU_MEMFD_KIND):
            raise InvalidArgument(f"not a CPU-device pool description: {d!r:.200}")
        name = d.get("name")
        fd = d.get("fd")
        if d["kind"] == CPU_MEMFD_KIND:
            if isinstance(fd, bool) or not isinstance(fd, int) or fd < 0:
                raise InvalidArgument("this tenant's own device pool comes as a file descriptor "
                                      "from the daemon's handshake, and none was received "
                                      "(connect over the Unix socket)")
            name = ""
        elif not isinstance(name, str) or not name:
            raise InvalidArgument("a CPU-device pool needs the name of its shared-memory "
                                  f"segment, got {name!r}")
        else:
            fd = None
        for key in ("device", "size", "pid"):
            v = d.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (key == "size" and v == 0):
                raise InvalidArgument(f"pool {key} must be a non-negative integer, got {v!r}")
        return cls(d["device"], name, d["size"], d["pid"], fd)


class CpuPool:
    """The CPU device's slab mapped into this process: `.ptr`/`.size` like a `DevicePool`,
    `.device` None (host memory: `PagedCopier` runs its torch path on the CPU), `.array` the
    whole slab as 1-D uint8 numpy (zero copy)."""

    def __init__(self, desc: CpuPoolDesc) -> None:
        from .shm import attach, attach_fd

        self.desc = desc
        if desc.fd is not None:     # the session keeps its fd; the mapping gets a copy
            self.slab = attach_fd(os.dup(desc.fd), desc.size)
        else:
            self.slab = attach(desc.name, desc.size)
        self.array: np.ndarray = self.slab.array
        self.ptr = int(self.array.ctypes.data)
        self.size = desc.size
        self.device = None
        self.local = False
        self._ino = _shm_ino(desc.name) if desc.fd is None else _fd_ino(desc.fd)

    @property
    def closed(self) -> bool:
        return self.slab.closed

    def current(self) -> bool:
        """False once the daemon replaced its segment (a restart): re-open from a new desc."""
        if self.desc.fd is not None:
            # The client's session holds the fd while that daemon run lasts; a new session
            # (daemon restart) closes it, so its number no longer names this memfd.
            return not self.closed and _fd_ino(self.desc.fd) == self._ino
        return not self.closed and _shm_ino(self.desc.name) == self._ino

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise InvalidArgument(f"pool range [{offset}, {offset + nbytes}) is outside the "
                                  f"{self.size}-byte pool")
        return self.array[offset:offset + nbytes]

    def close(self) -> None:
        with _pools_lock:
            if _pools.get(_cpu_key(self.desc)) is self:
                del _pools[_cpu_key(self.desc)]
        self.array = None  # type: ignore[assignment]
        self.slab.close()


def _cpu_key(d: CpuPoolDesc) -> bytes:
    if d.fd is not None:            # one mapping per memfd (its inode), however often handed
        return b"cpufd:%d" % os.fstat(d.fd).st_ino
    return b"cpu:" + d.name.encode()


def _fd_ino(fd: int) -> int | None:
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


def _shm_ino(name: str) -> int | None:
    try:
        return os.stat(os.path.join("/dev/shm", name)).st_ino
    except OSError:
        return None


def _open_cpu_pool(d: CpuPoolDesc) -> CpuPool:
    key = _cpu_key(d)
    with _pools_lock:
        hit = _pools.get(key)
    if isinstance(hit, CpuPool) and hit.current() and hit.size == d.size:
        return hit
    if isinstance(hit, CpuPool) and d.fd is not None and not hit.closed and hit.size == d.size:
        # The same memfd (the key is its inode) through another fd, e.g. a second client of
        # the tenant: keep the mapping, which others may be copying through, and follow the
        # fd that is open now.
        hit.desc, hit._ino = d, _fd_ino(d.fd)
        return hit
    if hit is not None:
        hit.close()
    pool = CpuPool(d)
    with _pools_lock:
        _pools[key] = pool
    return pool


def open_pool(desc: dict | PoolDesc | CpuPoolDesc, device: int | None = None
              ) -> DevicePool | CpuPool:
    """Map the daemon pool `desc` once per process; later calls return the same mapping.

    A CPU-device description (`kind == "cpu_shm"`) maps its shared-memory slab instead.

    `device`: the device to map it on when the pool's GPU is not visible here (peer access is
    enabled lazily). A pool with the same `name` but another handle (the daemon restarted) is
    closed first: its memory belongs to a dead daemon.
    """
    global _pools_pid
    if isinstance(desc, CpuPoolDesc) or (isinstance(desc, dict) and desc.get("kind") in
                                         (CPU_POOL_KIND, CPU_MEMFD_KIND)):
        return _open_cpu_pool(desc if isinstance(desc, CpuPoolDesc)
                              else CpuPoolDesc.parse(desc))
    d = desc if isinstance(desc, PoolDesc) else PoolDesc.parse(desc)
    torch = require_cuda(None, "open GPU pool")
    with _pools_lock:
        if _pools_pid != os.getpid():   # forked: inherited mappings are not valid here
            _pools.clear()
            _pools_pid = os.getpid()
        hit = _pools.get(d.handle)
        if hit is not None and not hit.closed:
            return hit
        stale = [p for p in _pools.values()
                 if isinstance(p, DevicePool) and d.name and p.desc.name == d.name]
        local = _local_exports.get(d.handle)
    for p in stale:
        p.close()
    if local is not None:
        pool = DevicePool(d, local[0], local[1], local=True)
    else:
        if d.pid == os.getpid():
            raise InvalidArgument("this process exported the pool but has no record of it "
                                  "(closed GPU tier?)")
        dev = _local_device_for(d, torch)
        if dev is None:
            dev = device if device is not None else torch.cuda.current_device()
        require_cuda(dev, "open GPU pool")
        ptr = get_runtime().ipc_open_mem_handle(dev, d.handle)
        pool = DevicePool(d, ptr, dev, local=False)
    with _pools_lock:
        _pools[d.handle] = pool
    return pool


def close_all_pools() -> None:
    """Unmap every pool this process opened (also runs at exit)."""
    with _pools_lock:
        pools = list(_pools.values())
    for p in pools:
        try:
            p.close()
        except Exception:  # exiting: the driver reclaims mappings with the process anyway
            pass


atexit.register(close_all_pools)
