"""One codec name, one stored format, whatever tier a block leaves for SSD from.

A block demoted from host and the same bytes flushed from a device's gpu copy must be stored
as the same value: the same codec, the same payload version, byte for byte. Otherwise a codec
name would mean two formats (device-side quantizing once wrote lossy payload v2 on CUDA and v4
on the CPU device), and a reader, a migration or a size bound would have to know where a block
had been. The CPU device runs on every machine; the CUDA variant runs where there is a GPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from kvstore_client import KVLayout
from kvstore_client import gpu as cg

from kvstore.config import StoreConfig
from kvstore.store import Store
from tiers import frame
from tiers.codecs import lossy

from .store_helpers import kv_block, namespace, random_prompt

HAS_CUDA = cg.cuda_available()
LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, block_tokens=16, dtype="bfloat16")
BACKENDS = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU with CUDA "
                                         "(torch.cuda.is_available() is False)")])]


def store_on(tmp_path: Path, backend: str) -> Store:
    cfg = StoreConfig(data_dir=str(tmp_path / "data"))
    cfg.gpu.enabled, cfg.gpu.capacity, cfg.gpu.backend = True, 4 << 20, backend
    cfg.host.capacity = 4 << 20
    cfg.ssd.capacity = 64 << 20
    cfg.ssd.compress = "always"         # lossless is encoded too, not stored raw
    return Store(cfg)


def stored(store: Store, gkey: bytes) -> tuple[str, bytes]:
    value = store.ssd.get(gkey)
    assert value is not None, "the block is not on SSD"
    codec, _, payload = frame.unframe(value)
    return codec, bytes(payload)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("codec", ["fp8_e4m3", "int8", "lossless"])
def test_a_block_flushed_from_a_device_is_stored_as_from_host(tmp_path, backend, codec):
    rng = np.random.default_rng(7)
    with store_on(tmp_path, backend) as store:
        ns = namespace(store, LAYOUT, codec=codec)
        (dev,) = store.gpu
        _, (via_host,) = random_prompt(rng, 1, LAYOUT)
        _, (via_gpu,) = random_prompt(rng, 1, LAYOUT)
        block = kv_block(via_host, LAYOUT)              # the same bytes under two keys
        store.put(ns, [via_host], [block])
        lease = store.reserve(ns, 1, tier="gpu")
        (slot,) = lease.slots
        if backend == "cpu":
            store.gpu[dev].view(slot.offset, slot.length)[:] = np.frombuffer(block, np.uint8)
        else:
            store.gpu[dev].copy_from_host_checked([(slot.offset, 0, len(block))],
                                                  np.frombuffer(block, np.uint8).copy())
        assert store.commit(lease.id, [via_gpu]).stored == 1
        e = store.index.get(ns + via_gpu)
        assert e.gpu is not None and e.host is None and not e.ssd     # only the device has it
        store.flush()
        host_codec, host_payload = stored(store, ns + via_host)
        gpu_codec, gpu_payload = stored(store, ns + via_gpu)
        assert store.stats()["counters"]["bytes_gpu_to_ssd"] > 0     # it left from the device
    assert host_codec == gpu_codec == codec
    if codec != "lossless":
        assert host_payload[0] == gpu_payload[0] == lossy.VERSION
    assert gpu_payload == host_payload, "the device's flush stored another format"
