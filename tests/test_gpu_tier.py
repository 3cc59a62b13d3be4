"""GPU tier and SDK GPU copies.

CPU tests cover everything that does not need a device: lazy imports, the Unavailable path and
its single log line, the pinned-registration no-op, pool-description validation, transfer
planning (block table → run addresses) for several engine layouts, and the torch execution of
those plans on host memory (the same code the GPU runs without Triton).

Tests marked `cuda` need an NVIDIA GPU and skip cleanly elsewhere: two processes sharing blocks
bit-exactly through the pool, a client killed mid-transfer, daemon restart and re-attach,
GPU → host → SSD → GPU with each codec, pinning of the shm slab, leak checks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from kvstore_client import gpu as cg
from kvstore_client import paged_copy
from kvstore_client.common import pools
from kvstore_client.common.layout import KVLayout
from kvstore_client.errors import DeadlineExceeded, InvalidArgument, Unavailable

from tests import optional_deps

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = cg.cuda_available()
cuda_only = [pytest.mark.cuda,
             pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU with CUDA "
                                "(torch.cuda.is_available() is False)")]


def cuda_test(fn):
    for m in cuda_only:
        fn = m(fn)
    return fn


LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16, dtype="float16")


def make_caches(layout: KVLayout, num_blocks: int, seed: int | None, kind: str = "vllm",
                device: str = "cpu") -> tuple[list[torch.Tensor], cg.PagedKVCache]:
    """Engine caches in several real layouts; seed=None gives zeros."""
    T, H, D, L = layout.block_tokens, layout.num_kv_heads, layout.head_dim, layout.num_layers
    dt = getattr(torch, layout.dtype)
    g = torch.Generator().manual_seed(seed or 0)

    def fill(shape):
        if seed is None:
            return torch.zeros(shape, dtype=dt)
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dt)

    if kind == "vllm":            # flash-attn: [2, blocks, T, H, D] per layer
        raw = [fill((2, num_blocks, T, H, D)).to(device) for _ in range(L)]
        return raw, cg.PagedKVCache.from_vllm(raw, kv_dim=0)
    if kind == "flashinfer":      # [blocks, 2, T, H, D] per layer
        raw = [fill((num_blocks, 2, T, H, D)).to(device) for _ in range(L)]
        return raw, cg.PagedKVCache.from_vllm(raw, kv_dim=1)
    if kind == "padded":          # heads padded to H+1 (only head_dim runs are contiguous)
        raw = [fill((2, num_blocks, T, H + 1, D)).to(device) for _ in range(L)]
        return raw, cg.PagedKVCache([(t[0, :, :, :H], t[1, :, :, :H]) for t in raw])
    if kind == "head_major":      # TensorRT-LLM-like [blocks, 2, H, T, D]: head_dim runs only
        raw = [fill((num_blocks, 2, H, T, D)).to(device) for _ in range(L)]
        return raw, cg.PagedKVCache([(t[:, 0].transpose(1, 2), t[:, 1].transpose(1, 2))
                                     for t in raw])
    if kind == "token_major":     # SGLang-like token pools [blocks*T, H, D], viewed per block
        raw = [fill((2, num_blocks * T, H, D)).to(device) for _ in range(L)]
        return raw, cg.PagedKVCache([(t[0].view(num_blocks, T, H, D),
                                      t[1].view(num_blocks, T, H, D)) for t in raw])
    raise ValueError(kind)


def canonical_block(cache: cg.PagedKVCache, b: int) -> torch.Tensor:
    """The block as the pool stores it: [L, 2, T, H, D], contiguous."""
    ts = cache.tensors
    return torch.stack([torch.stack([ts[2 * i][b], ts[2 * i + 1][b]])
                        for i in range(len(ts) // 2)]).contiguous()


class HostRegion:
    """A CPU 'pool': the same PagedCopier plans run on host memory."""

    def __init__(self, nbytes: int) -> None:
        self.buf = torch.zeros(nbytes, dtype=torch.uint8)
        self.ptr = self.buf.data_ptr()
        self.size = nbytes
        self.device = None

    def block(self, off: int, layout: KVLayout) -> torch.Tensor:
        return self.buf[off:off + layout.block_bytes].view(getattr(torch, layout.dtype)) \
            .view(layout.block_shape)


# =============================================================================================
# CPU tests
# =============================================================================================
def test_imports_are_lazy_and_work_without_torch_or_cupy():
    code = (
        "import sys\n"
        "sys.modules['cupy'] = None; sys.modules['triton'] = None; sys.modules['torch'] = None\n"
        "import tiers.gpu, tiers.cuda_util, kvstore_client.gpu as g\n"
        "import numpy as np\n"
        "assert not g.cuda_available()\n"
        "p = g.pin_host(np.zeros(4096, np.uint8)); assert not p.pinned; p.close()\n"
        "try:\n"
        "    tiers.gpu.GPUTier(1 << 20)\n"
        "except g.Unavailable as e:\n"
        "    assert 'no CUDA device' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('GPUTier did not raise')\n"
        "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "client")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_import_does_not_load_cuda_stacks():
    code = ("import sys, tiers.gpu, kvstore_client.gpu\n"
            "print(sorted(m for m in ('cupy', 'triton', 'tiers.codecs') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "client")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_tier_without_cuda_raises_unavailable(no_cuda):
    from tiers.gpu import GPUTier

    with pytest.raises(Unavailable, match="no CUDA device"):
        GPUTier(1 << 20, 0)


def test_daemon_picks_the_cpu_device_without_cuda_and_says_so(no_cuda, caplog):
    from tiers.device_cpu import CpuDeviceTier
    from tiers.device_open import open_device_tiers

    log = logging.getLogger("kvstore.test")
    with caplog.at_level(logging.INFO, logger="kvstore.test"):
        tiers = open_device_tiers(1 << 20, [0, 1], "auto", log, slab_prefix="test-pick-")
    try:
        assert sorted(tiers) == [0, 1]
        assert all(isinstance(t, CpuDeviceTier) for t in tiers.values())
        lines = [r for r in caplog.records if r.name == "kvstore.test"]
        assert len(lines) == 1 and "CPU device" in lines[0].getMessage()
        assert "no CUDA device" in lines[0].getMessage()
    finally:
        for t in tiers.values():
            t.close()


def test_daemon_disables_cuda_backend_with_one_log_line(no_cuda, caplog):
    from tiers.device_open import open_device_tiers

    log = logging.getLogger("kvstore.test")
    with caplog.at_level(logging.INFO, logger="kvstore.test"):
        assert open_device_tiers(1 << 30, [0, 1], "cuda", log) == {}
    lines = [r for r in caplog.records if r.name == "kvstore.test"]
    assert len(lines) == 1 and "gpu tier disabled" in lines[0].getMessage()
    with pytest.raises(InvalidArgument, match="gpu.backend"):
        open_device_tiers(1 << 20, [0], "tpu", log)


def test_pin_host_is_a_noop_without_cuda(no_cuda):
    arr = np.zeros(1 << 16, np.uint8)
    with cg.pin_host(arr) as p:
        assert not p.pinned and p.reason == "no CUDA device"
        assert p.nbytes == arr.nbytes and p.ptr == arr.ctypes.data
    with pytest.raises(Unavailable, match="no CUDA device"):
        cg.pin_host(arr, required=True)


def test_open_pool_without_cuda(no_cuda):
    desc = {"kind": "cuda_ipc", "device": 0, "handle": b"\1" * 64, "size": 1 << 20, "pid": 1}
    with pytest.raises(Unavailable, match="no CUDA device"):
        cg.open_pool(desc)


def test_pool_desc_validation():
    good = {"kind": "cuda_ipc", "device": 0, "handle": bytes(range(64)), "size": 1 << 20,
            "pid": 123, "uuid": "GPU-x", "name": "gpu0"}
    d = cg.PoolDesc.parse(good)
    assert d.handle == bytes(range(64)) and d.size == 1 << 20 and d.name == "gpu0"
    assert cg.PoolDesc.parse(dict(good, handle=bytes(range(64)).hex())).handle == d.handle
    for bad in (dict(good, kind="shm"), dict(good, handle=b"x" * 63), dict(good, handle="zz"),
                dict(good, size=0), dict(good, device=-1), dict(good, pid=True),
                dict(good, handle=None)):
        with pytest.raises(InvalidArgument):
            cg.PoolDesc.parse(bad)


def _geoms(cache: cg.PagedKVCache) -> list[cg.TensorGeom]:
    return cache.geoms()


def test_plan_dense_vllm_layout_is_one_run_per_layer_part():
    L = LAYOUT
    raw, cache = make_caches(L, 10, 1, "vllm")
    pool_addr, pool_size = 1 << 40, 1 << 20
    blocks, slots = [7, 2, 5], [0, 65536, 32768]
    plan = cg.plan_block_runs(_geoms(cache), L, blocks, slots, pool_addr, pool_size)
    chunk = L.block_tokens * L.num_kv_heads * L.head_dim * L.itemsize
    assert plan.run_bytes == chunk
    assert plan.engine.size == len(blocks) * 2 * L.num_layers
    for i, (b, s) in enumerate(zip(blocks, slots, strict=True)):
        for c in range(2 * L.num_layers):
            layer, kv = divmod(c, 2)
            k = i * 2 * L.num_layers + c
            assert plan.pool[k] == pool_addr + s + c * chunk
            assert plan.engine[k] == raw[layer][kv, b].data_ptr()


def test_plan_padded_heads_uses_per_token_runs():
    L = LAYOUT
    raw, cache = make_caches(L, 4, 1, "padded")
    plan = cg.plan_block_runs(_geoms(cache), L, [3], [4096], 0, 1 << 20)
    assert plan.run_bytes == L.num_kv_heads * L.head_dim * L.itemsize   # heads x dim per token
    assert plan.engine.size == 2 * L.num_layers * L.block_tokens
    assert plan.engine[1] == raw[0][0, 3, 1, 0].data_ptr()
    assert plan.pool[1] == 4096 + plan.run_bytes


def test_plan_head_major_uses_head_dim_runs():
    L = LAYOUT
    raw, cache = make_caches(L, 4, 1, "head_major")
    plan = cg.plan_block_runs(_geoms(cache), L, [3], [4096], 0, 1 << 20)
    assert plan.run_bytes == L.head_dim * L.itemsize
    assert plan.engine.size == 2 * L.num_layers * L.block_tokens * L.num_kv_heads
    # canonical run (t=1, h=1) of layer 0 K sits at raw[0][3, 0, h=1, t=1]
    assert plan.engine[L.num_kv_heads + 1] == raw[0][3, 0, 1, 1].data_ptr()
    assert plan.pool[L.num_kv_heads + 1] == 4096 + (L.num_kv_heads + 1) * plan.run_bytes


@pytest.mark.parametrize("bad, match", [
    (dict(blocks=[10]), "outside"),
    (dict(blocks=[-1]), "negative"),
    (dict(slots=[(1 << 20) - 4096]), "past the"),
    (dict(blocks=[1, 2], slots=[0]), "2 block ids but 1"),
    (dict(blocks=[[1]]), "1-D"),
])
def test_plan_rejects_bad_batches(bad, match):
    _, cache = make_caches(LAYOUT, 10, 1)
    blocks, slots = bad.get("blocks", [1]), bad.get("slots", [0])
    with pytest.raises(InvalidArgument, match=match):
        cg.plan_block_runs(_geoms(cache), LAYOUT, blocks, slots, 0, 1 << 20)


def test_plan_rejects_wrong_cache_shapes():
    _, cache = make_caches(LAYOUT, 10, 1)
    other = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_tokens=16,
                     dtype="float16")
    with pytest.raises(InvalidArgument, match="shape"):
        cg.plan_block_runs(_geoms(cache), other, [0], [0], 0, 1 << 20)
    fewer = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, block_tokens=16,
                     dtype="float16")
    with pytest.raises(InvalidArgument, match="K/V tensors"):
        cg.plan_block_runs(_geoms(cache), fewer, [0], [0], 0, 1 << 20)
    bf = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16)
    with pytest.raises(InvalidArgument, match="dtype"):
        cg.PagedCopier(HostRegion(1 << 20), cache, bf)


def test_plan_refuses_tensors_whose_elements_overlap_within_a_block():
    """Heads broadcast with expand (stride 0), or a head axis stepping inside head_dim, put
    several elements of one block at one address: a load would leave the last value written
    in all of them (other bytes than the block), so the plan refuses such a cache as it
    refuses blocks that overlap. Padded and permuted layouts stay accepted."""
    L = LAYOUT
    T, H, D = L.block_tokens, L.num_kv_heads, L.head_dim
    dt = getattr(torch, L.dtype)
    broadcast = [torch.zeros((6, T, 1, D), dtype=dt).expand(6, T, H, D) for _ in range(2 * 4)]
    raw = [torch.zeros((6, T, D + 1), dtype=dt) for _ in range(2 * 4)]
    inside = [torch.as_strided(r, (6, T, H, D), (T * (D + 1), D + 1, 1, 1)) for r in raw]
    for tensors in (broadcast, inside):
        cache = cg.PagedKVCache([(tensors[2 * i], tensors[2 * i + 1]) for i in range(4)])
        with pytest.raises(InvalidArgument, match="elements of one block overlap"):
            cg.static_plan(cache.geoms(), L)
        for method in ("torch", "runs"):
            with pytest.raises(InvalidArgument, match="elements of one block overlap"):
                cg.PagedCopier(HostRegion(1 << 20), cache, L, method=method)
    for kind in ("padded", "head_major", "token_major"):
        cg.static_plan(make_caches(L, 4, None, kind)[1].geoms(), L)


@pytest.mark.parametrize("method", ["auto", "torch", "runs"])
@pytest.mark.parametrize("kind", ["vllm", "flashinfer", "padded", "head_major", "token_major"])
def test_cpu_store_then_load_round_trip(kind, method):
    L = LAYOUT
    _, src = make_caches(L, 12, 7, kind)
    pool = HostRegion(1 << 20)
    blocks = [11, 0, 5, 6, 3]
    slots = [5 * 32768, 0, 3 * 32768, 32768, 7 * 32768]
    t = cg.PagedCopier(pool, src, L, method=method).store(blocks, slots)
    big_runs = kind in ("vllm", "flashinfer", "token_major")   # whole [T, H, D] runs
    want = method if method != "auto" else ("runs" if big_runs else "torch")
    assert t.done() and t.method == want and t.nbytes == 5 * L.block_bytes
    for b, s in zip(blocks, slots, strict=True):
        assert torch.equal(pool.block(s, L), canonical_block(src, b))
    for kind2 in ("vllm", "flashinfer", "padded", "head_major"):
        _, dst = make_caches(L, 9, None, kind2)
        targets = [8, 1, 4, 2, 0]
        cg.PagedCopier(pool, dst, L, method=method).load(targets, slots).wait()
        for b, b2 in zip(blocks, targets, strict=True):
            assert torch.equal(canonical_block(dst, b2), canonical_block(src, b))
        untouched = set(range(9)) - set(targets)
        for b2 in untouched:
            assert not canonical_block(dst, b2).any()


def test_cpu_copy_is_bounded_staging(monkeypatch):
    """The torch path stages through a bounded temporary (many steps, same result)."""
    monkeypatch.setattr(paged_copy, "TORCH_STAGE_BYTES", 8192)
    L = LAYOUT
    _, src = make_caches(L, 40, 3)
    pool = HostRegion(40 * L.block_bytes)
    rng = np.random.default_rng(0)
    blocks = rng.permutation(40)[:32]
    slots = rng.permutation(40)[:32] * L.block_bytes
    cg.PagedCopier(pool, src, L).store(torch.from_numpy(blocks), slots)
    for b, s in zip(blocks, slots, strict=True):
        assert torch.equal(pool.block(int(s), L), canonical_block(src, int(b)))


def test_duplicate_destinations_are_refused():
    _, cache = make_caches(LAYOUT, 10, 1)
    cp = cg.PagedCopier(HostRegion(1 << 20), cache, LAYOUT)
    with pytest.raises(InvalidArgument, match="twice"):
        cp.store([1, 2], [0, 0])
    with pytest.raises(InvalidArgument, match="twice"):
        cp.load([3, 3], [0, 32768])


@pytest.mark.parametrize("bad, match", [
    (dict(blocks=[10]), "outside"),
    (dict(blocks=[-1]), "negative"),
    (dict(blocks=np.array([1 << 63], dtype=np.uint64)), "negative"),
    (dict(slots=[-4096]), "negative"),
    (dict(slots=[(1 << 20) - 4096]), "past the"),
    (dict(blocks=[1, 2], slots=[0]), "2 block ids but 1"),
    (dict(blocks=[3, 3], slots=[0, 32768]), "twice"),
    (dict(blocks=[1, 2], slots=[0, 4096], to_pool=True), "twice"),
])
def test_staged_checks_refuse_what_check_batch_refuses(bad, match):
    """The GPU path checks a batch once it is staged: same refusals, same words."""
    from kvstore_client.copy_plan import check_staged, index_array, write_batch

    _, cache = make_caches(LAYOUT, 10, 1)
    sp = cg.static_plan(cache.geoms(), LAYOUT)
    blocks = index_array("block_ids", bad.get("blocks", [1]))
    slots = index_array("slot_offsets", bad.get("slots", [0]))
    out = np.zeros((2, 8), np.int64)[:, :blocks.size]
    with pytest.raises(InvalidArgument, match=match):
        write_batch(blocks, slots, out)
        check_staged(sp, LAYOUT, out, 1 << 20, bad.get("to_pool", False))


def test_write_batch_stages_the_batch_and_returns_the_slots_alignment():
    from kvstore_client.copy_plan import check_staged, index_array, write_batch
    from kvstore_client.triton_copy import bucket

    _, cache = make_caches(LAYOUT, 10, 1)
    sp = cg.static_plan(cache.geoms(), LAYOUT)
    out = np.zeros((2, 3), np.int64)
    bits = write_batch(index_array("b", torch.tensor([4, 0, 9])),
                       index_array("s", np.array([65536, 8, 131088], np.uint32)), out)
    check_staged(sp, LAYOUT, out, 1 << 20, True)
    assert out.tolist() == [[4, 0, 9], [65536, 8, 131088]]
    assert cg.copy_width(np.array([0]), bits) == 8
    with pytest.raises(InvalidArgument, match="1-D"):
        index_array("block_ids", [1.5])
    assert [bucket(n) for n in (0, 1, 64, 65, 1000)] == [64, 64, 64, 128, 1024]


def test_coalesce_runs_merges_only_runs_contiguous_on_both_sides():
    src = np.array([8192, 0, 4096, 20000], np.int64)
    dst = np.array([8192, 0, 4096, 50000], np.int64)
    n = np.array([4096, 4096, 4096, 100], np.int64)
    s, d, m = cg.coalesce_runs(src, dst, n)
    assert s.tolist() == [0, 20000] and d.tolist() == [0, 50000] and m.tolist() == [12288, 100]
    s, d, m = cg.coalesce_runs(np.array([0, 4096]), np.array([0, 9999]), np.array([4096, 4096]))
    assert m.tolist() == [4096, 4096]


def test_copy_width_picks_widest_aligned_element():
    assert cg.copy_width(np.array([0, 4096]), 4096) == 16
    assert cg.copy_width(np.array([8, 4096]), 64) == 8
    assert cg.copy_width(np.array([0]), 6) == 2
    assert cg.copy_width(np.array([3]), 64) == 1


def test_transfer_wait_has_a_deadline():
    class NeverDone:
        def query(self):
            return False

    t = cg.Transfer(NeverDone(), nbytes=1)
    assert not t.done()
    with pytest.raises(DeadlineExceeded):
        t.wait(0.05)
    cg.Transfer(None).wait(0)


def test_bench_runs_on_the_cpu_device_without_cuda():
    # CUDA hidden, so on a GPU machine too the bench takes its CPU-device path.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "client")]),
               CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--quick"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["cuda"] == "skipped: no CUDA device" and out["device_kind"] == "cpu"
    assert out["gpu_tier_gather_bytes_equal"] is True and out["corrupt_blocks"] == 0
    for key in ("gpu_tier_gather_vs_memcpy", "gpu_demote_vs_memcpy"):
        assert out[key] > 0          # a ratio was measured (its target lives in the bench)


def test_gpu_suite_says_in_one_line_that_it_skips_without_cuda(tmp_path):
    """The GPU proof's entry point exits 0 with one JSON line (and the same in --out)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "suite.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_suite.py"), "--out", str(out)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["cuda"] == "skipped: no CUDA device"
    assert json.loads(out.read_text()) == json.loads(lines[0])


# =============================================================================================
# CUDA tests (skip without a GPU)
# =============================================================================================
def _spawn(target, *args):
    ctx = mp.get_context("spawn")       # CUDA cannot be used in forked children
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q), daemon=True)
    p.start()
    return p, q


def _child_store(desc, seed, blocks, slots, method, q):
    try:
        torch.cuda.set_device(0)
        pool = cg.open_pool(desc)
        assert not pool.local
        _, cache = make_caches(LAYOUT, 16, seed, "vllm", "cuda")
        t = cg.PagedCopier(pool, cache, LAYOUT, method=method).store(blocks, slots)
        t.wait(30)
        q.put(("ok", t.method))
    except BaseException as e:  # report, never hang the parent
        q.put(("error", repr(e)))


def _child_load(desc, seed, blocks, slots, targets, kind, method, q):
    try:
        pool = cg.open_pool(desc)
        assert cg.open_pool(desc) is pool          # once per process
        _, ref = make_caches(LAYOUT, 16, seed, "vllm", "cuda")
        _, dst = make_caches(LAYOUT, 20, None, kind, "cuda")
        t = cg.PagedCopier(pool, dst, LAYOUT, method=method).load(targets, slots)
        t.wait_stream(torch.cuda.current_stream())
        ok = all(torch.equal(canonical_block(dst, b2), canonical_block(ref, b))
                 for b, b2 in zip(blocks, targets, strict=True))
        torch.cuda.synchronize()
        q.put(("ok", ok))
    except BaseException as e:
        q.put(("error", repr(e)))


def _child_hammer(desc, seed, slots, q):
    try:
        pool = cg.open_pool(desc)
        _, cache = make_caches(LAYOUT, 16, seed, "vllm", "cuda")
        cp = cg.PagedCopier(pool, cache, LAYOUT)
        q.put(("started", os.getpid()))
        while True:                     # killed from outside mid-transfer
            cp.store(list(range(len(slots))), slots).wait(30)
    except BaseException as e:
        q.put(("error", repr(e)))


def _child_reattach(q_in, q):
    try:
        while True:
            msg = q_in.get(timeout=120)
            if msg is None:
                break
            desc, fill = msg
            pool = cg.open_pool(desc)
            data = pool.tensor[:1 << 16].clone()
            torch.cuda.synchronize()
            q.put(("ok", bool((data == fill).all()), len(pools._pools)))
    except BaseException as e:
        q.put(("error", repr(e)))


def page_aligned(nbytes: int) -> np.ndarray:
    """Host buffers for pinning are page-aligned, like the shm slab."""
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


def _result(q, timeout=120):
    r = q.get(timeout=timeout)
    assert r[0] != "error", r[1]
    return r


@pytest.fixture
def tier():
    from tiers.gpu import GPUTier

    t = GPUTier(64 << 20, 0)
    yield t
    t.close()


@cuda_test
def test_in_process_client_uses_the_local_pointer(tier):
    pool = cg.open_pool(tier.describe())
    assert pool.local and pool.ptr == tier.view(0, 1).data_ptr()
    assert len(tier.describe()["handle"]) == 64


@cuda_test
@pytest.mark.parametrize("method", ["auto", "torch"])
def test_two_processes_share_blocks_bit_exactly(tier, method):
    rng = np.random.default_rng(1)
    slots = [tier.alloc(LAYOUT.block_bytes) for _ in range(8)]
    rng.shuffle(slots)
    blocks = [3, 7, 0, 15, 9, 4, 12, 1]
    p, q = _spawn(_child_store, tier.describe(), 11, blocks, slots, method)
    _result(q)
    p.join(60)
    assert p.exitcode == 0
    _, ref = make_caches(LAYOUT, 16, 11, "vllm", "cpu")
    for b, s in zip(blocks, slots, strict=True):
        got = tier.view(s, LAYOUT.block_bytes).cpu().view(torch.float16).view(LAYOUT.block_shape)
        assert torch.equal(got, canonical_block(ref, b))
    for kind in ("vllm", "flashinfer", "head_major"):
        targets = [19, 2, 5, 0, 11, 8, 13, 6]
        p, q = _spawn(_child_load, tier.describe(), 11, blocks, slots, targets, kind, method)
        assert _result(q)[1] is True
        p.join(60)


@cuda_test
def test_killed_client_leaks_nothing_and_corrupts_nothing(tier):
    pattern = torch.arange(tier.capacity, dtype=torch.int64, device="cuda:0") \
        .remainder(251).to(torch.uint8)
    tier.view(0, tier.capacity).copy_(pattern)
    torch.cuda.synchronize()
    own = [tier.alloc(LAYOUT.block_bytes) for _ in range(4)]
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info(0)
    p, q = _spawn(_child_hammer, tier.describe(), 5, own)
    assert _result(q)[0] == "started"
    time.sleep(0.5)
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    # the child's context and mappings are gone once it is reaped (measured before this
    # process allocates anything more)
    deadline = time.monotonic() + 20
    while torch.cuda.mem_get_info(0)[0] < free_before - (8 << 20) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert torch.cuda.mem_get_info(0)[0] >= free_before - (8 << 20)
    # nothing outside the client's own slots changed
    mask = torch.ones(tier.capacity, dtype=torch.bool, device="cuda:0")
    for s in own:
        mask[s:s + LAYOUT.block_bytes] = False
    assert torch.equal(tier.view(0, tier.capacity)[mask], pattern[mask])
    # and the pool still serves a fresh client
    p, q = _spawn(_child_store, tier.describe(), 6, [0, 1], own[:2], "auto")
    _result(q)
    p.join(60)


@cuda_test
def test_daemon_restart_client_reattaches():
    from tiers.gpu import GPUTier

    ctx = mp.get_context("spawn")
    q_in, q = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_child_reattach, args=(q_in, q), daemon=True)
    p.start()
    try:
        t1 = GPUTier(16 << 20, 0, slab_name="test-restart")
        t1.view(0, 1 << 16).fill_(7)
        torch.cuda.synchronize()
        q_in.put((t1.describe(), 7))
        assert _result(q)[1:] == (True, 1)
        t1.close()
        t2 = GPUTier(16 << 20, 0, slab_name="test-restart")
        t2.view(0, 1 << 16).fill_(9)
        torch.cuda.synchronize()
        q_in.put((t2.describe(), 9))
        assert _result(q)[1:] == (True, 1)     # the stale mapping was closed, not kept
        q_in.put(None)
        p.join(60)
        assert p.exitcode == 0
        t2.close()
    finally:
        if p.is_alive():
            p.kill()


@cuda_test
def test_tier_close_returns_all_gpu_memory():
    from tiers.gpu import GPUTier

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free0, _ = torch.cuda.mem_get_info(0)
    t = GPUTier(256 << 20, 0)
    assert torch.cuda.mem_get_info(0)[0] <= free0 - (256 << 20)
    host = page_aligned(4 << 20)
    t.pin_host(host)
    t.copy_from_host(0, 1 << 20, host)
    t.close()
    t.close()
    torch.cuda.empty_cache()
    assert torch.cuda.mem_get_info(0)[0] >= free0 - (2 << 20)


@cuda_test
def test_batched_host_copies_round_trip(tier):
    rng = np.random.default_rng(3)
    host = page_aligned(8 << 20)
    host[:] = rng.integers(0, 256, host.size, dtype=np.uint8)
    back = page_aligned(8 << 20)
    pin = tier.pin_host(host)
    assert pin.pinned
    offs = [tier.alloc(1 << 20) for _ in range(6)]
    items = [(g, i << 20, 1 << 20) for i, g in enumerate(reversed(offs))]
    up = tier.copy_from_host_batch(items, host)
    down = tier.copy_to_host_batch(items, back, after=up)
    down.wait(30)
    assert np.array_equal(back[:6 << 20], host[:6 << 20])
    tier.copy_to_host(offs[0], 4096, back)
    assert np.array_equal(back[:4096], host[5 << 20:(5 << 20) + 4096])
    for o in offs:
        tier.free(o)
    assert tier.used_bytes == 0
    with pytest.raises(InvalidArgument):
        tier.copy_to_host_batch([(tier.capacity - 10, 0, 20)], back)


@cuda_test
def test_shm_slab_pinned_in_daemon_and_client():
    from kvstore_client.common.shm import attach

    from tiers.host import HostTier

    host = HostTier(16 << 20)
    try:
        pin = cg.pin_host(host.array)
        assert pin.pinned and torch.from_numpy(host.array).is_pinned()
        slab = attach(host.shm_name, host.capacity)
        cpin = cg.pin_host(slab.array)     # same pages, another mapping: also registers
        assert cpin.pinned
        cpin.close()
        slab.close()
        pin.close()
        assert not torch.from_numpy(host.array).is_pinned()
    finally:
        host.close()


@cuda_test
@pytest.mark.parametrize("codec, tol", [("lossless", 0.0), ("fp8_e4m3", 0.08), ("int8", 0.02)])
def test_gpu_host_ssd_gpu_round_trip(tier, tmp_path, codec, tol):
    from tiers import codecs, frame
    from tiers import ssd as ssd_mod
    from tiers.host import HostTier

    L = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16, dtype="bfloat16")
    host = HostTier(8 << 20)
    ssd = ssd_mod.SSDTier(str(tmp_path / "ssd"), 64 << 20)
    pin = tier.pin_host(host.array)
    try:
        g = torch.Generator().manual_seed(5)
        block = torch.randn(L.block_shape, generator=g).to(torch.bfloat16)
        raw = block.view(-1).view(torch.uint8).numpy()
        goff = tier.alloc(L.block_bytes)
        hoff = host.alloc(L.block_bytes)
        tier.view(goff, L.block_bytes).copy_(torch.from_numpy(raw))
        # GPU -> host (pinned shm slab)
        tier.copy_to_host(goff, L.block_bytes, host.view(hoff, L.block_bytes))
        assert np.array_equal(host.view(hoff, L.block_bytes), raw)
        # host -> SSD, encoded on the CPU; and GPU -> SSD, quantized on the GPU
        payload = codecs.encode(codec, host.view(hoff, L.block_bytes), L)
        gpu_payload = tier.encode_batch([(goff, L.block_bytes)], codec, L).result(60)[0]
        ssd.put(b"k" * 32, frame.frame(codec, L.block_bytes, payload), b"")
        ssd.put(b"g" * 32, frame.frame(codec, L.block_bytes, gpu_payload), b"")
        for key in (b"k" * 32, b"g" * 32):
            name, raw_len, body = frame.unframe(ssd.get(key))
            assert (name, raw_len) == (codec, L.block_bytes)
            hoff2 = host.alloc(L.block_bytes)
            codecs.decode(name, body, L, host.view(hoff2, L.block_bytes))
            goff2 = tier.alloc(L.block_bytes)
            tier.copy_from_host(goff2, L.block_bytes, host.view(hoff2, L.block_bytes))
            back = tier.view(goff2, L.block_bytes).view(torch.bfloat16).view(L.block_shape).cpu()
            if tol == 0:
                assert torch.equal(back.view(torch.int16), block.view(torch.int16))
            else:
                err = (back.float() - block.float()).norm() / block.float().norm()
                assert err <= tol, f"{codec}: relative error {err:.4f}"
    finally:
        pin.close()
        ssd.close()
        host.close()


@cuda_test
def test_triton_and_torch_paths_agree(tier):
    optional_deps.module("triton", "the CUDA build of torch installs it")
    pool = cg.open_pool(tier.describe())
    slots = [tier.alloc(LAYOUT.block_bytes) for _ in range(6)]
    for kind in ("vllm", "flashinfer", "padded", "head_major", "token_major"):
        _, src = make_caches(LAYOUT, 16, 21, kind, "cuda")
        for method in ("triton", "torch"):
            tier.view(0, tier.capacity).zero_()
            t = cg.PagedCopier(pool, src, LAYOUT, method=method).store([5, 1, 9, 2, 14, 0], slots)
            t.wait(30)
            assert t.method == method
            for b, s in zip([5, 1, 9, 2, 14, 0], slots, strict=True):
                got = tier.view(s, LAYOUT.block_bytes).view(torch.float16).view(LAYOUT.block_shape)
                assert torch.equal(got, canonical_block(src, b)), (kind, method)


@cuda_test
@pytest.mark.parametrize("launch", ["graph", "launch"])
def test_every_launch_mode_moves_every_batch_exactly(tier, launch):
    """Batches in several size buckets, two of one bucket in flight at once (the staging
    buffer is reused only once the first is done), an `after` chain, and bad batches refused
    on the GPU path with nothing moved."""
    optional_deps.module("triton", "the CUDA build of torch installs it")
    L = LAYOUT
    pool = cg.open_pool(tier.describe())
    slots = [tier.alloc(L.block_bytes) for _ in range(198)]
    _, src = make_caches(L, 256, 5, "vllm", "cuda")
    _, dst = make_caches(L, 256, None, "flashinfer", "cuda")
    store = cg.PagedCopier(pool, src, L, method="triton", launch=launch)
    load = cg.PagedCopier(pool, dst, L, method="triton", launch=launch)
    rng = np.random.default_rng(3)
    blocks = rng.permutation(256)[:198]
    pending, at = [], 0
    for n in (1, 5, 63, 64, 65):        # buckets 64, 64, 64, 64, 128; no waits in between
        t = store.store(blocks[at:at + n], slots[at:at + n],
                        after=pending[-1] if pending else None)
        pending.append(t)
        at += n
    for t in pending:
        t.wait(30)
    for b, s in zip(blocks.tolist(), slots, strict=True):
        got = tier.view(s, L.block_bytes).view(torch.float16).view(L.block_shape)
        assert torch.equal(got, canonical_block(src, b)), (launch, b)
    targets = rng.permutation(256)[:198]
    load.load(targets, slots).wait(30)                   # bucket 256
    for b, b2 in zip(blocks.tolist(), targets.tolist(), strict=True):
        assert torch.equal(canonical_block(dst, b2), canonical_block(src, b)), (launch, b2)
    assert not canonical_block(dst, int(np.setdiff1d(np.arange(256), targets)[0])).any()
    # Out of bounds: refused, and the kernel (already running when the host's checks fail)
    # moved nothing, to the pool or to the engine's cache.
    before, cache_before = tier.view(0, tier.capacity).clone(), canonical_block(dst, 0)
    for bad, match in [(([256], slots[:1]), "outside"), (([0], [tier.capacity]), "past the"),
                       (([-1], slots[:1]), "negative"), (([0], [-4096]), "negative")]:
        with pytest.raises(InvalidArgument, match=match):
            store.store(*bad)
        with pytest.raises(InvalidArgument, match=match):
            load.load(*bad)
    torch.cuda.synchronize()
    assert torch.equal(tier.view(0, tier.capacity), before)
    assert torch.equal(canonical_block(dst, 0), cache_before)
    # A batch refused for one entry moved its in-bounds entries (the caller named them) and
    # is done by the time the error is raised; so is a slot named twice.
    spare = slots[0]
    with pytest.raises(InvalidArgument, match="negative"):
        store.store([7, -1], [spare, slots[1]])
    got = tier.view(spare, L.block_bytes).view(torch.float16).view(L.block_shape)
    assert torch.equal(got, canonical_block(src, 7))
    with pytest.raises(InvalidArgument, match="twice"):
        store.store([1, 2], [spare] * 2)
    assert store._triton.mode == launch and load._triton.mode == launch, store._triton.mode


@cuda_test
@pytest.mark.parametrize("engine_stream", ["default", "side"])
def test_a_copy_waits_for_what_the_engine_queued_before_it(tier, engine_stream):
    """The copier skips ordering only when the engine's current stream is idle: work still
    queued there (a long GPU spin, then writes to the blocks) must land before the copy reads
    them, on the default stream and on a stream of the engine's own."""
    optional_deps.module("triton", "the CUDA build of torch installs it")
    L = LAYOUT
    pool = cg.open_pool(tier.describe())
    slots = [tier.alloc(L.block_bytes) for _ in range(4)]
    raw, src = make_caches(L, 8, None, "vllm", "cuda")
    store = cg.PagedCopier(pool, src, L, method="triton")
    side = torch.cuda.Stream()
    for value in (3.0, 5.0):
        ctx = torch.cuda.stream(side) if engine_stream == "side" else contextlib.nullcontext()
        with ctx:
            torch.cuda._sleep(200_000_000)          # ~0.1 s of GPU time queued first
            for t in raw:
                t.fill_(value)
            t = store.store([0, 1, 2, 3], slots)
        t.wait(30)
        for s in slots:
            got = tier.view(s, L.block_bytes).view(torch.float16)
            assert bool((got == value).all()), (engine_stream, value)


@cuda_test
def test_cuda_device_keeps_the_interface_the_store_uses(tier):
    """What kvstore/moves/gpu_host.py calls, on CUDA: checked copies, checksums, gather."""
    import xxhash

    host = page_aligned(4 << 20)
    host[:] = np.random.default_rng(9).integers(0, 256, host.size, dtype=np.uint8)
    offs = [tier.alloc(1 << 20) for _ in range(3)]
    items = [(g, i << 20, 1 << 20) for i, g in enumerate(offs)]
    want = [xxhash.xxh3_64_intdigest(host[i << 20:(i + 1) << 20]) for i in range(3)]
    assert tier.copy_from_host_checked(items, host) == want
    assert tier.checksums([(g, 1 << 20) for g in offs]) == want
    dst = tier.alloc(1 << 20)
    tier.gather([(offs[2], dst, 1 << 20)]).wait(30)
    back = page_aligned(4 << 20)
    assert tier.copy_to_host_checked([(dst, 0, 1 << 20)], back) == want[2:]
    assert tier.describe()["kind"] == cg.CUDA_POOL_KIND
