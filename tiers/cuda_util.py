"""Daemon-side CUDA helpers: the exportable device slab, host pinning, device identity.

Why this module is thin: the raw runtime wrapper (CuPy, or ctypes on libcudart), host
registration and IPC opening are needed by clients too, and `kvstore_client` may not import
`tiers`, so they live in the SDK's shared layer (`kvstore_client/common/`) and are re-exported
here. This module adds
what only the daemon does: allocate a slab with plain cudaMalloc (never through torch's caching
allocator or CuPy's pools, whose blocks share one IPC handle per segment with offsets), export
it once, and free it.

Everything imports lazily: importing this module needs neither torch's CUDA nor CuPy.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from kvstore_client.common.cuda_runtime import (
    IPC_HANDLE_BYTES,
    CudaError,
    cuda_available,
    device_tensor,
    get_runtime,
    require_cuda,
)
from kvstore_client.common.errors import InvalidArgument, ResourceExhausted
from kvstore_client.common.pinning import PinnedHost, pin_host
from kvstore_client.common.pools import register_local_export, unregister_local_export

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["IPC_HANDLE_BYTES", "CudaError", "DeviceSlab", "PinnedHost", "cuda_available",
           "device_identity", "export_ipc_handle", "open_ipc_handle", "close_ipc_handle",
           "pin_host", "require_cuda"]

_ERR_MEMORY_ALLOCATION = 2


def export_ipc_handle(device: int, ptr: int) -> bytes:
    """cudaIpcGetMemHandle of a cudaMalloc'd base pointer: 64 opaque bytes another process opens."""
    handle = get_runtime().ipc_get_mem_handle(device, ptr)
    if len(handle) != IPC_HANDLE_BYTES:
        raise CudaError(f"IPC handle is {len(handle)} bytes, expected {IPC_HANDLE_BYTES}")
    return handle


def open_ipc_handle(device: int, handle: bytes) -> int:
    """cudaIpcOpenMemHandle(LazyEnablePeerAccess). Fails for the exporting process's own handle;
    clients should use `kvstore_client.gpu.open_pool`, which caches and handles that case."""
    if len(handle) != IPC_HANDLE_BYTES:
        raise InvalidArgument(f"IPC handle must be {IPC_HANDLE_BYTES} bytes")
    return get_runtime().ipc_open_mem_handle(device, bytes(handle))


def close_ipc_handle(device: int, ptr: int) -> None:
    get_runtime().ipc_close_mem_handle(device, ptr)


def device_identity(device: int) -> dict[str, Any]:
    """Names that survive CUDA_VISIBLE_DEVICES renumbering (clients match on `uuid`)."""
    torch = require_cuda(device, "device identity")
    props = torch.cuda.get_device_properties(device)
    out: dict[str, Any] = {"model": props.name, "total_memory": int(props.total_memory)}
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        out["uuid"] = str(uuid)
    for key in ("pci_bus_id", "pci_device_id", "pci_domain_id"):
        if hasattr(props, key):
            out[key] = int(getattr(props, key))
    return out


class DeviceSlab:
    """`size` bytes of cudaMalloc'd memory on `device`, zeroed and exported as one IPC handle.

    Zeroed because cudaMalloc memory may hold a previous process's data, and pool slots are
    handed to other tenants' clients. The slab registers itself as a local export so an
    in-process client (tests, an embedded daemon) gets the pointer instead of opening its own
    handle, which CUDA refuses.
    """

    def __init__(self, size: int, device: int = 0) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise InvalidArgument(f"device slab size must be a positive integer, got {size!r}")
        torch = require_cuda(device, "gpu tier")
        rt = get_runtime()
        self.size = size
        self.device = device
        self.pid = os.getpid()
        try:
            self.ptr = rt.malloc(device, size)
        except CudaError as e:
            if e.status == _ERR_MEMORY_ALLOCATION:
                free, total = torch.cuda.mem_get_info(device)
                raise ResourceExhausted(
                    f"cannot allocate a {size / 2**30:.2f} GiB GPU slab on cuda:{device}: "
                    f"{free / 2**30:.2f} of {total / 2**30:.2f} GiB free; lower gpu.capacity"
                ) from None
            raise
        try:
            self._tensor: torch.Tensor | None = device_tensor(self.ptr, size, device, self)
            with torch.cuda.device(device):
                self._tensor.zero_()
                torch.cuda.synchronize(device)
            self.handle = export_ipc_handle(device, self.ptr)
        except BaseException:
            self._tensor = None
            rt.free(device, self.ptr)
            raise
        register_local_export(self.handle, self.ptr, device)

    @property
    def tensor(self) -> torch.Tensor:
        """The slab as a 1-D uint8 CUDA tensor (zero copy)."""
        if self._tensor is None:
            raise InvalidArgument("GPU slab is closed")
        return self._tensor

    @property
    def closed(self) -> bool:
        return self._tensor is None

    def close(self) -> None:
        """Drain the device, forget the local export, cudaFree. Idempotent.

        Clients that still map the slab keep valid mappings until they close them (the driver
        frees the memory with the last mapping); a restarted daemon exports a new handle.
        """
        if self._tensor is None:
            return
        if os.getpid() != self.pid:   # forked child: the allocation is not ours to free
            self._tensor = None
            return
        import torch

        self._tensor = None
        unregister_local_export(self.handle)
        torch.cuda.synchronize(self.device)
        get_runtime().free(self.device, self.ptr)

