"""The one-pass block copy (kvstore_client/blockcopy.py): bytes, checksums, fallbacks.

The kernel's checksums must be the daemon's xxh3-64 bit for bit (the daemon rejects a Commit
whose checksums differ, and a load refuses a block whose checksum differs), so every test here
compares against the xxhash module and against plain numpy copies.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash
from kvstore_client import KVLayout, blockcopy, connect
from kvstore_client.buffers import aligned_buffer

from tests import kernel_checks
from tests.daemon import cleanup, start_daemon


@pytest.fixture
def copy_kernel() -> None:
    kernel_checks.require("the SDK's copy kernel", blockcopy.kernel_status())


# These tests mean the compiled kernel: they fail where it does not load (never a quiet skip).
# The fallback path has tests of its own, named for it.
needs_kernel = pytest.mark.usefixtures("copy_kernel")


def _seq(L: int, N: int, H: int, D: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-2**15, 2**15, (L, 2, N, H, D), dtype=np.int16)


def _block(x: np.ndarray, i: int, T: int) -> bytes:
    return np.ascontiguousarray(x[:, :, i * T:(i + 1) * T]).tobytes()


@needs_kernel
@pytest.mark.parametrize("L,H,D,T", [(4, 2, 64, 16), (3, 3, 5, 7), (1, 1, 4, 1)])
@pytest.mark.parametrize("threads", [1, 3])
def test_gather_and_scatter_match_numpy_and_xxhash(L: int, H: int, D: int, T: int,
                                                    threads: int) -> None:
    n = 9
    x = _seq(L, n * T + 3, H, D, seed=L * 100 + T)        # a trailing partial block
    plan = blockcopy.seq_plan(x, T)
    assert plan is not None and plan.block_bytes == L * 2 * T * H * D * 2
    bb = plan.block_bytes
    pool = aligned_buffer(2 * n * bb + 64)
    offsets = [(2 * (n - 1 - j) * bb) + 8 for j in range(n)]   # reversed, spread, unaligned
    blocks = [5, 0, 8, 1, 2, 3, 4, 6, 7]
    sums = np.zeros(n, dtype=np.uint64)
    blockcopy.run(plan, pool, blocks, offsets, True, sums, threads)
    for j, i in enumerate(blocks):
        want = _block(x, i, T)
        assert bytes(pool[offsets[j]:offsets[j] + bb]) == want
        assert int(sums[j]) == xxhash.xxh3_64_intdigest(want)

    y = np.zeros_like(x)
    back = np.zeros(n, dtype=np.uint64)
    blockcopy.run(blockcopy.seq_plan(y, T), pool, blocks, offsets, False, back, threads)
    assert np.array_equal(y[:, :, :n * T], x[:, :, :n * T])
    assert not y[:, :, n * T:].any()                      # the partial block is never touched
    assert np.array_equal(back, sums)


@needs_kernel
@pytest.mark.parametrize("L,H,D,T", [(4, 2, 64, 16), (2, 8, 128, 16), (3, 1, 64, 8),
                                     (1, 1, 512, 1)])
@pytest.mark.parametrize("threads", [1, 3])
def test_one_pass_xxh3_kernel_is_xxhash_bit_for_bit(L: int, H: int, D: int, T: int,
                                                    threads: int) -> None:
    """Rows of whole 1 KiB XXH3 blocks take the kernel that runs XXH3 inside the copy
    (move_blocks_x3): the same bytes and the xxhash library's digest, both ways, on 1, 2 and
    many XXH3 blocks per block, and the same answers as the two-pass kernel."""
    n = 7
    x = _seq(L, n * T, H, D, seed=L * 7 + D)
    plan = blockcopy.seq_plan(x, T)
    bb = plan.block_bytes
    pool = aligned_buffer(n * bb + 4096)
    offsets = [(n - 1 - j) * bb for j in range(n)]
    blocks = [3, 0, 6, 1, 5, 2, 4]
    assert blockcopy._fused_hash_fits(plan, plan.eng_blk[blocks], np.array(offsets),
                                      blockcopy._addr(pool), True)
    sums = np.zeros(n, dtype=np.uint64)
    blockcopy.run(plan, pool, blocks, offsets, True, sums, threads)
    for j, i in enumerate(blocks):
        want = _block(x, i, T)
        assert bytes(pool[offsets[j]:offsets[j] + bb]) == want
        assert int(sums[j]) == xxhash.xxh3_64_intdigest(want)
    y = np.zeros_like(x)
    back = np.zeros(n, dtype=np.uint64)
    blockcopy.run(blockcopy.seq_plan(y, T), pool, blocks, offsets, False, back, threads)
    assert np.array_equal(y, x) and np.array_equal(back, sums)
    # A destination off the 32-byte grid takes the two-pass kernel: the same answers.
    raw = np.zeros(x.nbytes + 8, dtype=np.uint8)
    z = raw[8:].view(np.int16).reshape(x.shape)
    zplan = blockcopy.seq_plan(z, T)
    assert not blockcopy._fused_hash_fits(zplan, zplan.eng_blk[blocks], np.array(offsets),
                                          blockcopy._addr(pool), False)
    again = np.zeros(n, dtype=np.uint64)
    blockcopy.run(zplan, pool, blocks, offsets, False, again, threads)
    assert np.array_equal(z, x) and np.array_equal(again, sums)


@needs_kernel
def test_checksums_are_of_the_slot_bytes_whichever_way_they_move() -> None:
    x = _seq(2, 32, 2, 16, seed=3)
    plan = blockcopy.seq_plan(x, 16)
    pool = aligned_buffer(4 * plan.block_bytes)
    pool[:] = np.random.default_rng(4).integers(0, 256, pool.nbytes, dtype=np.uint8)
    sums = np.zeros(2, dtype=np.uint64)
    blockcopy.run(plan, pool, [0, 1], [0, 2 * plan.block_bytes], False, sums, 2)  # load
    for j, off in enumerate((0, 2 * plan.block_bytes)):
        assert int(sums[j]) == xxhash.xxh3_64_intdigest(pool[off:off + plan.block_bytes])
    no_hash = np.zeros_like(x)
    blockcopy.run(blockcopy.seq_plan(no_hash, 16), pool, [0, 1], [0, 2 * plan.block_bytes],
                  False, None, 2)
    assert np.array_equal(no_hash, x)


@needs_kernel
def test_run_refuses_a_slot_outside_the_pool() -> None:
    x = _seq(1, 16, 1, 8, seed=5)
    plan = blockcopy.seq_plan(x, 16)
    pool = aligned_buffer(plan.block_bytes)
    with pytest.raises(ValueError, match="outside the pool"):
        blockcopy.run(plan, pool, [0], [8], True, None, 1)


def test_plans_only_what_the_kernel_can_address() -> None:
    x = _seq(2, 32, 4, 8, seed=6)
    assert blockcopy.seq_plan(x, 16) is not None
    assert blockcopy.seq_plan(x[:, :, :, :, :4], 16) is None            # rows not contiguous
    assert blockcopy.seq_plan(x[:, :, ::-1], 16) is None                 # negative stride
    assert blockcopy.seq_plan(x.transpose(0, 1, 3, 2, 4), 16) is None   # heads before tokens
    assert blockcopy.seq_plan(x[0], 16) is None                          # not 5-D
    picked = x[[1, 0]]                                                    # a copy: contiguous
    assert blockcopy.seq_plan(picked, 16) is not None


# ------------------------------------------------------------------ through a daemon

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=32, block_tokens=16, dtype="bfloat16")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    d = start_daemon(tmp_path_factory.mktemp("blockcopy"))
    try:
        yield d
    finally:
        cleanup(d)


def _kv(seed: int, tokens: int, extra_dim: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    L, _, _, H, D = LAYOUT.block_shape
    return torch.randn((L, 2, tokens, H, D + extra_dim), generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("threads", [1, 4])
def test_store_and_load_give_back_the_bytes(daemon, threads: int) -> None:
    with connect(daemon.address, transport="shm", copy_threads=threads) as c:
        ns = c.namespace(LAYOUT, model=f"bc/{threads}")
        ids = np.arange(7 * 16 + 5)
        kv = _kv(1, len(ids))
        assert ns.store(ids, kv) == 7
        out = torch.zeros_like(kv)
        assert ns.load(ids, out=out) == 7 * 16
        assert torch.equal(out[:, :, :112].view(torch.int16), kv[:, :, :112].view(torch.int16))
        assert not out[:, :, 112:].view(torch.int16).any()
        assert c.counters["checksum_failures"] == 0


def test_layouts_the_kernel_cannot_address_fall_back(daemon) -> None:
    """Rows that are not contiguous (a slice of a wider head_dim) go through numpy copies."""
    with connect(daemon.address, transport="shm") as c:
        ns = c.namespace(LAYOUT, model="bc/fallback")
        ids = np.arange(3 * 16)
        wide = _kv(2, len(ids), extra_dim=8)
        kv = wide[..., :LAYOUT.head_dim]
        assert blockcopy.seq_plan(kv.view(torch.int16).numpy(), 16) is None
        assert ns.store(ids, kv) == 3
        out_wide = torch.zeros_like(wide)
        assert ns.load(ids, out=out_wide[..., :LAYOUT.head_dim]) == 3 * 16
        assert torch.equal(out_wide[..., :LAYOUT.head_dim].view(torch.int16),
                           kv.view(torch.int16))
        assert not out_wide[..., LAYOUT.head_dim:].view(torch.int16).any()


@needs_kernel
def test_a_corrupt_slot_ends_the_loaded_prefix(daemon) -> None:
    """The fused load checks each block in its copy pass: block 1 flipped -> 1 block served."""
    with connect(daemon.address, transport="shm") as c:
        ns = c.namespace(LAYOUT, model="bc/corrupt")
        ids = np.arange(3 * 16) + 1000
        kv = _kv(3, len(ids))
        assert ns.store(ids, kv) == 3
        from kvstore_client._proto import kvstore_pb2 as pb
        lease = c.call("Acquire", pb.AcquireRequest(namespace_id=ns.ns_id, keys=ns.keys(ids)))
        c.release(lease.lease.lease_id)
        where = lease.lease.slots[1].offset + 77
        c.pool.slab.array[where] ^= 0x40                   # a stray write into block 1
        out = torch.zeros_like(kv)
        assert ns.load(ids, out=out) == 16
        assert c.counters["checksum_failures"] == 1
        assert torch.equal(out[:, :, :16].view(torch.int16), kv[:, :, :16].view(torch.int16))
        c.pool.slab.array[where] ^= 0x40                   # repaired: all three again
        assert ns.load(ids, out=out) == 3 * 16
        assert torch.equal(out.view(torch.int16), kv.view(torch.int16))


def test_copy_threads_must_be_a_count(daemon) -> None:
    from kvstore_client import InvalidArgument
    with pytest.raises(InvalidArgument, match="copy_threads"):
        connect(daemon.address, copy_threads=-1)


@needs_kernel
@pytest.mark.parametrize("kv_axis,page_axis", [(0, 1), (1, 0)])
def test_paged_plan_gathers_pages_of_separate_layer_tensors(kv_axis: int, page_axis: int) -> None:
    """vLLM-style caches: one allocation per layer; block j of a move is page table[j]."""
    L, P, T, H, D = 3, 6, 4, 2, 8
    shape = [0, 0, T, H, D]
    shape[kv_axis], shape[page_axis] = 2, P
    rng = np.random.default_rng(9)
    layers = [rng.integers(-2**15, 2**15, shape, dtype=np.int16) for _ in range(L)]
    plan = blockcopy.paged_plan(layers, kv_axis, page_axis)
    assert plan is not None and plan.block_bytes == L * 2 * T * H * D * 2
    table = [4, 0, 5]
    pool = aligned_buffer(3 * plan.block_bytes)
    offsets = [j * plan.block_bytes for j in range(3)]
    sums = np.zeros(3, dtype=np.uint64)
    blockcopy.run(plan, pool, table, offsets, True, sums, 2)
    for j, page in enumerate(table):
        want = np.stack([np.moveaxis(x, (page_axis, kv_axis), (0, 1))[page] for x in layers])
        got = pool[offsets[j]:offsets[j] + plan.block_bytes]
        assert got.tobytes() == want.tobytes()
        assert int(sums[j]) == xxhash.xxh3_64_intdigest(want.tobytes())
    with pytest.raises(ValueError, match="block indices"):
        blockcopy.run(plan, pool, [P], offsets[:1], True, None, 1)      # no such page
    assert blockcopy.paged_plan(layers[:1] + [layers[1][..., :4]], kv_axis, page_axis) is None


def test_get_stream_never_sends_a_corrupt_block(daemon) -> None:
    """The daemon verifies host bytes before they leave over Put/Get streams."""
    from kvstore_client._proto import kvstore_pb2 as pb
    with connect(daemon.address, transport="shm") as c, \
            connect(daemon.address, transport="grpc") as g:
        ns = c.namespace(LAYOUT, model="bc/get")
        ids = np.arange(3 * 16) + 2000
        kv = _kv(4, len(ids))
        assert ns.store(ids, kv) == 3
        lease = c.call("Acquire", pb.AcquireRequest(namespace_id=ns.ns_id, keys=ns.keys(ids)))
        c.release(lease.lease.lease_id)
        where = lease.lease.slots[1].offset + 5
        c.pool.slab.array[where] ^= 0x01
        gns = g.namespace(LAYOUT, model="bc/get")
        assert g.transport == "grpc"
        out = torch.zeros_like(kv)
        assert gns.load(ids, out=out) == 16
        assert torch.equal(out[:, :, :16].view(torch.int16), kv[:, :, :16].view(torch.int16))
        assert not out[:, :, 16:].view(torch.int16).any()
        assert g.stats()["counters"]["get_checksum_mismatch"] == 1
        # The changed copy was dropped, never kept: reads stop there until it is stored again.
        assert gns.load(ids, out=out) == 16
        assert ns.store(ids, kv) >= 1
        assert gns.load(ids, out=out) == 3 * 16
        assert torch.equal(out.view(torch.int16), kv.view(torch.int16))


@needs_kernel
@pytest.mark.parametrize("block_bytes", [32 << 10, 96 << 10, 12_345])
def test_rows_plan_moves_the_head_of_each_row_of_a_chunk_pool(block_bytes: int) -> None:
    # vLLM's primary tier: chunks of a 2-D pool, of which the first block_bytes are a block.
    chunks = np.random.default_rng(3).integers(0, 255, (6, block_bytes + 4096), dtype=np.uint8)
    plan = blockcopy.rows_plan(chunks, block_bytes)
    assert plan is not None and plan.block_bytes == block_bytes
    stride = (block_bytes + 4095) // 4096 * 4096
    pool = aligned_buffer(3 * stride)
    picked = [4, 0, 5]
    sums = np.zeros(3, dtype=np.uint64)
    blockcopy.run(plan, pool, picked, [0, stride, 2 * stride], True, sums, threads=2)
    for j, c in enumerate(picked):
        slot = pool[j * stride:j * stride + block_bytes]
        assert np.array_equal(slot, chunks[c, :block_bytes])
        assert int(sums[j]) == xxhash.xxh3_64_intdigest(slot)
    back = np.zeros_like(chunks)
    blockcopy.run(blockcopy.rows_plan(back, block_bytes), pool, [1, 2, 3],
                  [0, stride, 2 * stride], False, None, threads=1)
    assert np.array_equal(back[1:4, :block_bytes], chunks[picked, :block_bytes])
    assert not back[:, block_bytes:].any() and not back[0].any()
    assert blockcopy.rows_plan(chunks[:, ::2], 100) is None        # rows not contiguous
    assert blockcopy.rows_plan(chunks, chunks.shape[1] + 1) is None  # block past the row
