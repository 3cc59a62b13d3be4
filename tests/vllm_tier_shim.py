"""pytest plugin: vLLM's own secondary-tier tests, run against kvstore's tier.

Loaded into a pytest run of vLLM's `tests/v1/kv_offload/tiering/test_fs_tier.py` (fetched from
the vLLM release sdist by `make vllm-tests`; tests/test_vllm_contract.py starts the run, the
daemon and reads the result) in a vLLM environment:

    python -m pytest -p tests.vllm_tier_shim .engine-tests/vllm-0.32.0/tests/v1/kv_offload/...

What the plugin changes, and nothing else:
- **The tier.** vLLM's tests build `FileSystemTierManager`; the name (in its module, where the
  tests and vLLM's tier factory find it) is `KVStoreFsStandIn`, a KVStoreTier talking to the
  daemon at $KVSTORE_ADDRESS. Its settings map the fs tier's: `root_dir` is the tenant salt
  (each test's folder is a namespace of its own; two tiers given the same folder share one
  exactly when their chunk identities agree), `locality` and `enable_kv_events` pass through,
  and it declares the fs tier's medium (STORAGE), which the tests check on the events of the
  tier they built (KVStoreTier's own medium is CPU).
- **"The file exists", "corrupt the file".** `file_mapper.base_path` is `<root_dir>/<namespace
  id>`, and `get_file_name(key)` a file under it named by the daemon's key. After every job
  the files mirror the daemon: a file holds the block's bytes as the daemon serves them
  exactly while the daemon holds the block. A file the test overwrote or deleted is applied to
  the daemon before the next load of that key: its block's bytes are altered in the daemon's
  host pool (the checksum catches it) or the block is deleted.
- **The lookup probe.** `lookup_and_wait` waits on the fs tier's lookup manager; the stand-in's
  `_lookup_manager._pending_results.empty()` is True while KVStoreTier still has lookups
  in flight, and `_lookup_batch` lists them.
- **vLLM's block hashes** are seeded as vLLM's engine core seeds them (sha256), since the tier
  names its key space from them.

tests/engine_deselected.py is the one list of the engines' tests not run, each with why (here:
tests of the fs tier's own machinery, which KVStoreTier does not have).
tests/test_vllm_contract.py fails unless exactly those are deselected.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
import pytest

from tests.engine_deselected import VLLM_DESELECTED as DESELECTED


def pytest_configure(config: pytest.Config) -> None:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.kv_offload.tiering.fs import manager as fs_manager

    kcu.init_none_hash(get_hash_fn_by_name("sha256"))     # what vLLM's engine core does
    fs_manager.FileSystemTierManager = _stand_in()


def _name(nodeid: str) -> str:
    path, _, rest = nodeid.partition("::")
    return f"{os.path.basename(path)}::{rest}"


_REPORT: dict[str, Any] = {"outcomes": {}, "deselected": []}


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    keep, drop = [], []
    for item in items:
        (drop if _name(item.nodeid) in DESELECTED else keep).append(item)
    _REPORT["deselected"] = sorted(_name(i.nodeid) for i in drop)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    name = _name(report.nodeid)
    if report.when == "call" or report.outcome != "passed":
        # A failure in setup or teardown counts against the test as much as one in its body.
        if _REPORT["outcomes"].get(name) in (None, "passed"):
            _REPORT["outcomes"][name] = report.outcome


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """With $KVSTORE_CONTRACT_REPORT set, write what ran and what was deselected (JSON)."""
    import json

    from vllm import __version__

    path = os.environ.get("KVSTORE_CONTRACT_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({**_REPORT, "vllm": __version__, "exitstatus": int(exitstatus)}, f)


def _stand_in() -> type:
    from kvstore_client.vllm.tier import KVStoreTier
    from vllm.v1.kv_offload.base import Medium

    class KVStoreFsStandIn(KVStoreTier):
        """KVStoreTier where vLLM's tests build the fs tier (see the module docstring)."""

        medium = Medium.STORAGE

        def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                     root_dir: str, n_read_threads: int = 16, n_write_threads: int = 16,
                     enable_kv_events: bool = False, locality: str | None = None,
                     backpressure_detector: Any = None) -> None:
            super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector,
                             address=os.environ["KVSTORE_ADDRESS"], tenant_salt=str(root_dir),
                             io_threads=min(4, max(1, n_read_threads)),
                             enable_kv_events=enable_kv_events, locality=locality)
            self.file_mapper = _DaemonFiles(self, str(root_dir))
            self._lookup_manager = _LookupProbe(self._lookups)

        @property
        def _store_job_keys(self) -> dict[int, list[Any]]:
            return self._event_keys         # store jobs whose keys wait for their event

        def submit_store(self, job_metadata: Any) -> None:
            self.file_mapper.track(job_metadata.keys)
            super().submit_store(job_metadata)

        def submit_load(self, job_metadata: Any) -> None:
            self.file_mapper.track(job_metadata.keys)
            self.file_mapper.apply_tampering(job_metadata.keys)
            super().submit_load(job_metadata)

        def get_finished_jobs(self) -> Any:
            done = list(super().get_finished_jobs())
            self.file_mapper.mirror()
            return done

    return KVStoreFsStandIn


class _Pending:
    def __init__(self, lookups: Any) -> None:
        self._lookups = lookups

    def empty(self) -> bool:
        return self._lookups.pending()


class _LookupProbe:
    """The two things vLLM's tests read of the fs tier's lookup manager."""

    def __init__(self, lookups: Any) -> None:
        self._pending_results = _Pending(lookups)
        self._lookups = lookups

    @property
    def _lookup_batch(self) -> list[bytes]:
        return self._lookups.waiting_keys()


class _DaemonFiles:
    """Files standing for the daemon's blocks (see the module docstring)."""

    def __init__(self, tier: Any, root_dir: str) -> None:
        self.tier = tier
        self.root_dir = root_dir
        self._keys: dict[bytes, Any] = {}              # folded key -> vLLM offload key
        self._written: dict[str, str] = {}             # path -> digest of what was mirrored

    @property
    def base_path(self) -> str:
        return f"{self.root_dir}/{self.tier._namespace().ns_id.hex()}"

    def get_file_name(self, key: Any) -> str:
        from kvstore_client.vllm.keyspace import fold_key

        self.track([key])
        return f"{self.base_path}/{fold_key(key).hex()}.bin"

    def track(self, keys: Any) -> None:
        from kvstore_client.vllm.keyspace import fold_key

        for k in keys:
            self._keys[fold_key(k)] = k

    def _read(self, folded: list[bytes]) -> list[bytes | None]:
        """Each block's bytes as the daemon serves them (checksums verified), or None."""
        ns = self.tier._namespace()
        nb = self.tier.geometry.nbytes
        out: list[bytes | None] = []
        for f in folded:
            got: list[bytes] = []

            def drain(base: np.ndarray, offsets: Any, first: int, got: list = got) -> None:
                got.append(bytes(base[offsets[0]:offsets[0] + nb]))
            n = ns.load_blocks([f], drain)
            out.append(got[0] if n == 1 and got else None)
        return out

    def mirror(self) -> None:
        """Make every tracked key's file hold what the daemon holds for it."""
        if not self._keys:
            return
        base = self.base_path
        os.makedirs(base, exist_ok=True)
        folded = list(self._keys)
        where = self.tier._namespace().locate(folded, prefetch=False)
        held = [f for f, w in zip(folded, where, strict=True) if w is not None]
        blocks = dict(zip(held, self._read(held), strict=True))
        for f in folded:
            path = f"{base}/{f.hex()}.bin"
            data = blocks.get(f)
            if data is None:
                if os.path.lexists(path):
                    os.unlink(path)
                self._written.pop(path, None)
                continue
            digest = hashlib.sha256(data).hexdigest()
            if self._written.get(path) != digest or not os.path.isfile(path):
                with open(path, "wb") as fh:
                    fh.write(data)
                self._written[path] = digest

    def apply_tampering(self, keys: Any) -> None:
        """Files the test deleted or overwrote since the last mirror: the same to the daemon."""
        from kvstore_client.vllm.keyspace import fold_key

        base = self.base_path
        for k in keys:
            f = fold_key(k)
            path = f"{base}/{f.hex()}.bin"
            want = self._written.get(path)
            if want is None:
                continue
            if not os.path.isfile(path):
                self.tier._namespace().delete([f])
                self._written.pop(path, None)
                continue
            with open(path, "rb") as fh:
                if hashlib.sha256(fh.read()).hexdigest() != want:
                    self._corrupt(f)

    def _corrupt(self, folded: bytes) -> None:
        """Alter the block's bytes in the daemon's host pool (its checksum no longer holds)."""
        from kvstore_client._proto import kvstore_pb2 as pb

        ns = self.tier._namespace()
        client = ns.client
        lease = client.call("Acquire", pb.AcquireRequest(
            namespace_id=ns.ns_id, keys=[folded], tier="host", ttl_s=30)).lease
        try:
            off = int(lease.slots[0].offset)
            pool = client.pool.slab.array
            pool[off:off + 64] ^= 0xFF
        finally:
            client.release(lease.lease_id)
