"""Device side of the SDK, one import for engines: open the daemon's device pool by handle and
move blocks between it and the engine's own paged KV cache.

The work is split by job (each module's docstring says why it is shaped as it is):

| module | job |
| --- | --- |
| `cuda_runtime` | CUDA bindings (CuPy or libcudart), availability, device views (CUDA-only) |
| `pinning` | cudaHostRegister of host buffers; a no-op handle without CUDA |
| `pools` | open/close a pool once per process: CUDA IPC slabs, CPU-device shm slabs |
| `copy_plan` | block table -> equal-size contiguous runs (pure numpy) |
| `paged_copy` | `PagedKVCache`, `PagedCopier`: execute plans (Triton, or torch on GPU or CPU) |
| `triton_copy` | the Triton kernel, launched per batch or replayed as a CUDA graph |
| `transfer` | `Transfer`: completion of a copy, with a deadline |

`import kvstore_client.gpu` works with no torch, no CUDA, no CuPy; only calling into the GPU
paths needs them, and then a missing piece raises `Unavailable` naming what is missing.
"""

from __future__ import annotations

from .common.cuda_runtime import (
    IPC_HANDLE_BYTES,
    CudaError,
    CudaRuntime,
    cuda_available,
    device_tensor,
    get_runtime,
    require_cuda,
)
from .common.errors import Unavailable
from .common.pinning import PinnedHost, pin_host
from .common.pools import (
    CPU_MEMFD_KIND,
    CPU_POOL_KIND,
    CUDA_POOL_KIND,
    CpuPool,
    CpuPoolDesc,
    DevicePool,
    PoolDesc,
    close_all_pools,
    host_tensor,
    open_pool,
    register_local_export,
    unregister_local_export,
)
from .common.runs import coalesce_runs
from .common.transfer import FutureEvent, Transfer
from .copy_plan import (
    MAX_RUNS_PER_BLOCK,
    RunPlan,
    StaticPlan,
    TensorGeom,
    check_batch,
    check_distinct,
    copy_width,
    plan_block_runs,
    static_plan,
)
from .paged_copy import PagedCopier, PagedKVCache

__all__ = [
    "CPU_MEMFD_KIND", "CPU_POOL_KIND", "CUDA_POOL_KIND", "IPC_HANDLE_BYTES", "MAX_RUNS_PER_BLOCK",
    "CpuPool",
    "CpuPoolDesc", "CudaError", "CudaRuntime", "DevicePool", "FutureEvent", "PagedCopier",
    "PagedKVCache", "PinnedHost", "PoolDesc", "RunPlan", "StaticPlan", "TensorGeom",
    "Transfer", "Unavailable", "check_batch", "check_distinct", "close_all_pools",
    "coalesce_runs", "copy_width", "cuda_available", "device_tensor", "get_runtime",
    "host_tensor", "open_pool", "pin_host", "plan_block_runs", "register_local_export",
    "require_cuda", "static_plan", "unregister_local_export",
]
