"""Which device tier serves each configured device: CUDA or the CPU device.

`open_device_tiers` picks one per configured device: CUDA where a device exists, the CPU device
where none does and the operator enabled the tier (it says so in the log), or whichever
`gpu.backend` names; `open_tenant_segment` makes a tenant's own slab of the same kind. Why a
module of its own: the interface (tiers/device.py) must not import its implementations
(tiers/gpu.py, tiers/device_cpu.py), which import it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvstore_client.common.cuda_runtime import cuda_available
from kvstore_client.common.errors import InvalidArgument, KVStoreError

from .device import DeviceTier

BACKENDS = ("auto", "cuda", "cpu")


def open_device_tiers(capacity: int, devices: Sequence[int], backend: str = "auto",
                      log: logging.Logger | None = None,
                      slab_prefix: str = "") -> dict[int, DeviceTier]:
    """The daemon's device tiers, one per configured device.

    backend "auto": CUDA where this machine has a CUDA device, else the CPU device (logged once,
    so an operator who enabled the tier sees what serves it); "cuda": CUDA or nothing (a device
    that fails to start is logged and skipped); "cpu": the CPU device.
    """
    log = log or logging.getLogger("kvstore")
    if backend not in BACKENDS:
        raise InvalidArgument(f"gpu.backend must be one of {list(BACKENDS)}, got {backend!r}")
    use_cuda = backend == "cuda" or (backend == "auto" and cuda_available())
    if backend == "cuda" and not cuda_available():
        log.warning("gpu tier disabled: no CUDA device on this machine (torch.cuda is "
                    "unavailable) and gpu.backend=cuda; serving from host/ssd only")
        return {}
    tiers: dict[int, DeviceTier] = {}
    if not use_cuda:
        from .device_cpu import CpuDeviceTier

        why = ("gpu.backend=cpu" if backend == "cpu"
               else "no CUDA device on this machine")
        log.warning("gpu tier: %s; using the CPU device (a shared-memory slab stands in for "
                    "device memory) on devices %s", why, list(devices))
        for dev in devices:
            tiers[dev] = CpuDeviceTier(capacity, dev, slab_name=f"{slab_prefix}gpu{dev}")
        return tiers
    from .gpu import GPUTier

    for dev in devices:
        try:
            tiers[dev] = GPUTier(capacity, dev, slab_name=f"{slab_prefix}gpu{dev}")
        except KVStoreError as e:      # Unavailable, or ResourceExhausted: slab does not fit
            log.warning("gpu tier on cuda:%s disabled: %s", dev, e)
    return tiers


def open_tenant_segment(kind: str, size: int, device: int, name: str) -> DeviceTier:
    """A tenant's own slab on `device`, of the same kind as the device's shared slab: a memfd
    (CPU device: it reaches the tenant's clients only as a file descriptor) or a separate CUDA
    allocation with an IPC handle of its own (handed only to that tenant)."""
    if kind == "cpu":
        from .device_cpu import CpuDeviceTier

        return CpuDeviceTier(size, device, slab_name=name, memfd=True)
    from .gpu import GPUTier  # pragma: no cover - needs a CUDA device

    return GPUTier(size, device, slab_name=name)
