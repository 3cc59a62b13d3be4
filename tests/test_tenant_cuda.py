"""Per-tenant device slabs on a real CUDA device (skips cleanly without one).

tests/test_tenant_gpu.py runs the same daemon code on the CPU device everywhere; these tests
check what only CUDA has: each tenant with a gpu_quota receives a separate allocation with an
IPC handle of its own, sized to its quota; engines store into and load from it with
device-to-device copies; another process of the same tenant opens it by handle; and one
tenant's flood or full quota never touches another's blocks.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from kvstore_client import ResourceExhausted, connect
from kvstore_client import gpu as cg
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client.device_kv import DeviceKV

from tests.daemon import cleanup, start_daemon
from tests.test_tenant_gpu import BB, LAYOUT, TOKENS, T, keys_for, tenants_file

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not cg.cuda_available(),
                                 reason="needs an NVIDIA GPU with CUDA")]


def cuda_cache(num_blocks: int, seed: int | None) -> cg.PagedKVCache:
    L = LAYOUT
    shape = (2, num_blocks, T, L.num_kv_heads, L.head_dim)
    if seed is None:
        raw = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
               for _ in range(L.num_layers)]
    else:
        g = torch.Generator().manual_seed(seed)
        raw = [torch.randn(shape, generator=g).to(torch.bfloat16).cuda()
               for _ in range(L.num_layers)]
    return cg.PagedKVCache.from_vllm(raw)


def block_bits(c: cg.PagedKVCache, b: int) -> bytes:
    """Block b's bytes in the daemon's canonical order, read back to the host."""
    ts = c.tensors
    blk = torch.stack([torch.stack([ts[2 * i][b], ts[2 * i + 1][b]])
                       for i in range(len(ts) // 2)])
    return blk.contiguous().view(torch.int16).cpu().numpy().tobytes()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("tenantcuda")
    d = start_daemon(tmp, {"gpu.enabled": "true", "gpu.backend": "cuda",
                           "gpu.capacity": str(16 * BB), "host.capacity": "8MiB",
                           "ssd.capacity": "64MiB", "auth.tokens_file": str(tenants_file(tmp))})
    try:
        yield d
    finally:
        cleanup(d)


def test_each_tenant_gets_its_own_cuda_allocation(daemon) -> None:
    with connect(daemon.address, token=TOKENS["a"]) as a, \
            connect(daemon.address, token=TOKENS["b"]) as b, \
            connect(daemon.address, token=TOKENS["c"]) as c:
        for cl in (a, b, c):
            cl.namespace(LAYOUT, model="m")
        (pa,), (pb_,) = a.gpu_pools, b.gpu_pools
        assert (pa["kind"], pa["size"]) == (cg.CUDA_POOL_KIND, 16 * BB)
        assert (pb_["kind"], pb_["size"]) == (cg.CUDA_POOL_KIND, 8 * BB)
        assert pa["handle"] != pb_["handle"]
        assert c.gpu_pools == []


def test_flood_and_full_quota_stay_inside_the_tenants_slab(daemon) -> None:
    with connect(daemon.address, token=TOKENS["a"]) as a, \
            connect(daemon.address, token=TOKENS["b"]) as b:
        na, nb = a.namespace(LAYOUT, model="flood"), b.namespace(LAYOUT, model="flood")
        ca = cuda_cache(8, seed=1)
        ka = keys_for(na, 1, 8)
        assert DeviceKV(na, ca).store_keys(ka, list(range(8))) == 8
        assert na.lookup_result(ka).per_tier["gpu"] == 8
        dkb = DeviceKV(nb, cuda_cache(24, seed=2))
        kb = keys_for(nb, 2, 24)
        for i in range(0, 24, 4):                       # 3x B's 8-slot slab
            assert dkb.store_keys(kb[:i + 4], list(range(i + 4))) >= 4
        assert na.lookup_result(ka).per_tier["gpu"] == 8
        assert nb.lookup_result(kb).prefix_blocks == 24
        mine = cuda_cache(8, seed=None)
        assert DeviceKV(na, mine).load_keys(ka, list(range(8))) == 8
        assert all(block_bits(mine, i) == block_bits(ca, i) for i in range(8))
        # B's blocks that went down to host come back bit for bit too.
        # (6 at a time: a load promotes into B's 8-slot slab, which holds what fits.)
        back = cuda_cache(24, seed=None)
        dk_back = DeviceKV(nb, back)
        for i in range(0, 24, 6):
            assert dk_back.load_keys(kb[i:i + 6], list(range(i, i + 6))) == 6
        ref = cuda_cache(24, seed=2)
        assert all(block_bits(back, i) == block_bits(ref, i) for i in range(24))
        b.evict("gpu")
        held = b.call("Reserve", pb.ReserveRequest(namespace_id=nb.ns_id, count=7, tier="gpu"))
        try:
            with pytest.raises(ResourceExhausted, match="tenant b's gpu quota"):
                b.call("Reserve", pb.ReserveRequest(namespace_id=nb.ns_id, count=2, tier="gpu"))
        finally:
            b.release(held.lease.lease_id)
        assert na.lookup_result(ka).per_tier["gpu"] == 8


def _child_load(address: str, q) -> None:
    try:
        with connect(address, token=TOKENS["a"]) as a:
            na = a.namespace(LAYOUT, model="xproc")
            ka = keys_for(na, 3, 6)
            dst = cuda_cache(6, seed=None)
            got = DeviceKV(na, dst).load_keys(ka, list(range(6)))
            ref = cuda_cache(6, seed=3)
            q.put(("ok", got, all(block_bits(dst, i) == block_bits(ref, i) for i in range(6))))
    except BaseException as e:  # report, never hang the parent
        q.put(("error", repr(e), False))


def test_another_process_of_the_tenant_loads_over_ipc(daemon) -> None:
    with connect(daemon.address, token=TOKENS["a"]) as a:
        na = a.namespace(LAYOUT, model="xproc")
        ka = keys_for(na, 3, 6)
        assert DeviceKV(na, cuda_cache(6, seed=3)).store_keys(ka, list(range(6))) == 6
        torch.cuda.synchronize()
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_child_load, args=(daemon.address, q), daemon=True)
        p.start()
        try:
            status, got, same = q.get(timeout=120)
        finally:
            p.join(30)
        assert status == "ok", got
        assert (got, same) == (6, True)

