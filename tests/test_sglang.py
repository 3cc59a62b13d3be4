"""kvstore as SGLang's HiCache storage backend, driven by SGLang's own classes.

SGLang runs in its own environment (`.venv-sglang`, `make sglang-env`); each test starts
tests/sglang_runner.py there as a subprocess against a real daemon, so the writer and the
reader are separate processes with separate SGLang host pools (MHATokenToKVPoolHost), and the
backend is built by SGLang's StorageBackendFactory from the `dynamic` extra config. Without that
environment the tests skip, except under CI (CI set), where they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from kvstore_client import connect
from kvstore_client.common.layout import KVLayout
from kvstore_client.sglang import identity
from kvstore_client.sglang.pages import PageGeometry

from tests.daemon import cleanup, start_daemon

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "tests" / "sglang_runner.py"
RUN_DEADLINE_S = 300          # importing SGLang takes ~20 s on a loaded 2-core machine


def sglang_python() -> str:
    py = ROOT / ".venv-sglang" / "bin" / "python"
    if not py.exists():
        msg = ("the SGLang environment .venv-sglang is missing: build it with "
               "`make sglang-env`")
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return str(py)


def run(address: str, steps: list[dict], *, layouts: str = "layer_first",
        args: tuple[str, ...] = (), background: bool = False,
        env_extra: dict[str, str] | None = None) -> Any:
    cmd = [sglang_python(), str(RUNNER), "--address", address, "--layouts", layouts,
           "--steps", json.dumps(steps), *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "client"), str(ROOT)])}
    env.pop("KVSTORE_ADDRESS", None)
    env.pop("KVSTORE_NO_KERNEL", None)
    env.update(env_extra or {})
    if background:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, cwd=ROOT)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=RUN_DEADLINE_S)
    return result(p.returncode, p.stdout, p.stderr)


def result(rc: int, stdout: str, stderr: str) -> dict:
    assert rc == 0, f"sglang runner failed ({rc}):\n{stderr[-4000:]}"
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sgl_daemon(tmp_path_factory: pytest.TempPathFactory):
    sglang_python()
    d = start_daemon(tmp_path_factory.mktemp("sgl"))
    try:
        yield d
    finally:
        cleanup(d)


def test_pages_cross_processes_byte_equal_and_every_failure_is_a_miss(sgl_daemon) -> None:
    """Writer process A and reader process B, both built by SGLang's factory: B finds and
    reads back A's pages byte for byte (layer-first and page-first pools, v1 and flat calls);
    misses, a hole, another layout's keys and a corrupt page are False, never an exception."""
    a = run(sgl_daemon.address, [
        {"op": "set", "seed": 1, "pages": 12},
        {"op": "set", "seed": 2, "pages": 8, "layout": "page_first"},
        {"op": "set_flat", "seed": 3, "pages": 4},
    ], layouts="layer_first,page_first")
    assert a["backend"] == "kvstore_client.sglang.backend.KVStoreHiCache"
    assert a["is_hicache_storage"] and a["pool"] == "MHATokenToKVPoolHost"
    set1, set2, set3 = a["steps"]
    assert set1["ok"] == [True] * 12 and set2["ok"] == [True] * 8 and set3["ok"] is True
    assert a["stats"]["layer_first"]["pages_set"] == 16
    assert a["storage_metrics"] == {"type": "StorageMetrics", "prefetch_pgs": 0,
                                    "backup_pgs": 12 + 4}

    b = run(sgl_daemon.address, [
        {"op": "exists", "seed": 1, "pages": 12},
        {"op": "exists", "seed": 1, "pages": 12, "hole": 5},
        {"op": "get", "seed": 1, "pages": 12},
        {"op": "get", "seed": 2, "pages": 8, "layout": "page_first"},
        {"op": "exists", "seed": 1, "pages": 12, "layout": "page_first"},
        {"op": "get", "seed": 1, "pages": 4, "unknown": True},
        {"op": "exists", "seed": 9, "pages": 4},
        {"op": "get_flat", "seed": 3, "pages": 4},
        {"op": "corrupt", "seed": 1, "pages": 12, "page": 7},
        {"op": "get", "seed": 1, "pages": 12},
    ], layouts="layer_first,page_first")
    assert b["pid"] != a.get("pid")
    ex, hole, get1, get2, other_layout, miss, ex_miss, flat, corrupt, get_bad = b["steps"]
    assert ex["n"] == 12 and ex["single"] == [True, True]
    assert hole["n"] == 5                              # consecutive hits from the start
    assert get1["ok"] == [True] * 12 and get1["equal"] == [True] * 12
    assert get1["digests"] == set1["digests"]          # the writer's bytes, in another process
    assert get2["ok"] == [True] * 8 and get2["equal"] == [True] * 8
    assert get2["digests"] == set2["digests"]
    assert other_layout["n"] == 0                      # a page-first pool never reads layer-first
    assert miss["ok"] == [False] * 4 and ex_miss["n"] == 0 and ex_miss["single"] == [False] * 2
    assert flat["found"] == [True] * 4 and flat["equal"] == [True] * 4 and flat["single"]
    assert corrupt["corrupted"]
    assert get_bad["ok"] == [True] * 7 + [False] * 5   # verified prefix only
    assert get_bad["equal"] == [True] * 7
    stats = b["stats"]["layer_first"]
    assert stats["pages_get_failed"] == 4 + 5 and stats["errors"] == 0
    assert stats["checksum_failures"] == 1
    assert stats["engine_layout"].startswith("sglang-hicache:MHATokenToKVPoolHost:layer_first")
    assert b["stats"]["page_first"]["engine_layout"].startswith(
        "sglang-hicache:MHATokenToKVPoolHost:page_first")


def test_promote_ahead_from_ssd(sgl_daemon) -> None:
    """Pages only on SSD count as stored; batch_exists starts moving them into host memory,
    and the batch_get after it reads them back byte-equal."""
    run(sgl_daemon.address, [{"op": "set", "seed": 21, "pages": 6}])
    r = run(sgl_daemon.address, [
        {"op": "demote"},
        {"op": "locate", "seed": 21, "pages": 6},
        {"op": "exists", "seed": 21, "pages": 6},
        {"op": "locate", "seed": 21, "pages": 6, "wait_s": 20},
        {"op": "get", "seed": 21, "pages": 6},
    ])
    demote, before, ex, after, get = r["steps"]
    assert demote["evicted_blocks"] >= 6
    assert before["where"] == ["ssd"] * 6
    assert ex["n"] == 6
    assert r["stats"]["layer_first"]["exists_below_host"] >= 6
    assert after["where"] == ["host"] * 6               # promoted ahead of the get
    assert get["ok"] == [True] * 6 and get["equal"] == [True] * 6


def test_mla_pages_are_one_copy_for_every_tp_rank(sgl_daemon) -> None:
    """SGLang's MLA host pool: TP rank 0 (the storage writer) stores, TP rank 1 of the same
    model, in another process, reads the same pages. A replica rank asked to store (SGLang's
    controller does not ask it) stores into the same namespace, and what it reports stored
    is there. The writer copies with the SDK's kernel, the reader with the numpy fallback (no
    numba): the same bytes either way."""
    mla = ("--mla", "--tp-size", "2")
    w = run(sgl_daemon.address, [{"op": "set", "seed": 41, "pages": 8}],
            args=(*mla, "--tp-rank", "0"))
    assert w["pool"] == "MLATokenToKVPoolHost" and w["steps"][0]["ok"] == [True] * 8
    r = run(sgl_daemon.address, [
        {"op": "exists", "seed": 41, "pages": 8},
        {"op": "get", "seed": 41, "pages": 8},
        {"op": "set", "seed": 42, "pages": 4},
        {"op": "exists", "seed": 42, "pages": 4},
    ], args=(*mla, "--tp-rank", "1"), env_extra={"KVSTORE_NO_KERNEL": "1"})
    assert w["stats"]["layer_first"]["copy"] == "kernel"
    assert r["stats"]["layer_first"]["copy"] == "numpy"
    ex, get, replica_set, replica_ex = r["steps"]
    assert ex["n"] == 8 and get["ok"] == [True] * 8 and get["equal"] == [True] * 8
    assert get["digests"] == w["steps"][0]["digests"]
    assert replica_set["ok"] == [True] * 4 and replica_ex["n"] == 4
    assert r["stats"]["layer_first"]["engine_layout"].startswith(
        "sglang-hicache:MLATokenToKVPoolHost:layer_first")


def test_mha_tp_ranks_keep_their_own_pages_across_processes(sgl_daemon) -> None:
    """An MHA model's TP ranks hold different heads under the same page hashes: rank 0 and
    rank 1, each in its own process, store the same prompt; each reads back its own bytes,
    and a rank of another TP size finds nothing (no false hit across ranks or sizes)."""
    tp = ("--tp-size", "2")
    r0 = run(sgl_daemon.address, [{"op": "set", "seed": 51, "pages": 6}],
             args=(*tp, "--tp-rank", "0"))
    r1 = run(sgl_daemon.address, [
        {"op": "exists", "seed": 51, "pages": 6},       # rank 0's pages are not rank 1's
        {"op": "set", "seed": 52, "pages": 6},          # other bytes, same kind of prompt
        {"op": "get", "seed": 52, "pages": 6},
    ], args=(*tp, "--tp-rank", "1"))
    again0 = run(sgl_daemon.address, [
        {"op": "get", "seed": 51, "pages": 6},
        {"op": "exists", "seed": 52, "pages": 6},
    ], args=(*tp, "--tp-rank", "0"))
    other_size = run(sgl_daemon.address, [{"op": "exists", "seed": 51, "pages": 6}],
                     args=("--tp-size", "4", "--tp-rank", "0"))
    assert r0["steps"][0]["ok"] == [True] * 6
    ex1, set1, get1 = r1["steps"]
    assert ex1["n"] == 0
    assert set1["ok"] == [True] * 6 and get1["ok"] == [True] * 6 and get1["equal"] == [True] * 6
    get0, ex0 = again0["steps"]
    assert get0["ok"] == [True] * 6 and get0["equal"] == [True] * 6
    assert get0["digests"] == r0["steps"][0]["digests"]
    assert ex0["n"] == 0
    assert other_size["steps"][0]["n"] == 0


def test_every_host_pool_layout_clear_and_tenant_salt(sgl_daemon) -> None:
    """page_first_direct and page_head pools store and load byte-equal across processes, each
    in a namespace of its own; `clear()` (SGLang's "clear HiCache storage") empties its own
    namespace and no other; a backend with another `tenant_salt` sees none of these pages."""
    layouts = "page_first_direct,page_head,layer_first"
    salt = ("--tenant-salt", "tenant-a")
    w = run(sgl_daemon.address, [
        {"op": "set", "seed": 101, "pages": 6, "layout": "page_first_direct"},
        {"op": "set", "seed": 102, "pages": 6, "layout": "page_head"},
        {"op": "set", "seed": 103, "pages": 6, "layout": "layer_first"},
    ], layouts=layouts, args=salt)
    assert [st["ok"] for st in w["steps"]] == [[True] * 6] * 3
    r = run(sgl_daemon.address, [
        {"op": "get", "seed": 101, "pages": 6, "layout": "page_first_direct"},
        {"op": "get", "seed": 102, "pages": 6, "layout": "page_head"},
        {"op": "exists", "seed": 101, "pages": 6, "layout": "page_head"},
        {"op": "exists", "seed": 103, "pages": 6, "layout": "layer_first"},
        {"op": "clear", "layout": "layer_first"},
        {"op": "exists", "seed": 103, "pages": 6, "layout": "layer_first"},
        {"op": "exists", "seed": 101, "pages": 6, "layout": "page_first_direct"},
        {"op": "exists", "seed": 102, "pages": 6, "layout": "page_head"},
    ], layouts=layouts, args=salt)
    pfd, ph, cross, before, clear, after, kept_pfd, kept_ph = r["steps"]
    for got, wrote in ((pfd, w["steps"][0]), (ph, w["steps"][1])):
        assert got["ok"] == [True] * 6 and got["equal"] == [True] * 6
        assert got["digests"] == wrote["digests"]
    assert cross["n"] == 0                       # a page-head pool never reads another layout
    assert before["n"] == 6 and clear["ok"] is True and after["n"] == 0
    assert kept_pfd["n"] == 6 and kept_ph["n"] == 6
    assert r["stats"]["page_head"]["engine_layout"].startswith(
        "sglang-hicache:MHATokenToKVPoolHost:page_head")
    other = run(sgl_daemon.address, [
        {"op": "exists", "seed": 101, "pages": 6, "layout": "page_first_direct"},
        {"op": "exists", "seed": 102, "pages": 6, "layout": "page_head"},
    ], layouts="page_first_direct,page_head", args=("--tenant-salt", "tenant-b"))
    assert [st["n"] for st in other["steps"]] == [0, 0]


def test_lossy_codec_through_the_extra_config(sgl_daemon) -> None:
    """`"codec": "int8"` in SGLang's extra config: the MHA pool's layout is declared, the
    daemon quantizes pages on their way to SSD, and pages loaded from there are close to, not
    equal to, what was stored (K and V of each head quantized apart)."""
    r = run(sgl_daemon.address, [
        {"op": "set", "seed": 111, "pages": 4, "normal": True},
        {"op": "demote"},
        {"op": "get", "seed": 111, "pages": 4, "normal": True, "measure": True},
    ], args=("--codec", "int8"))
    put, demote, get = r["steps"]
    st = r["stats"]["layer_first"]
    assert put["ok"] == [True] * 4 and demote["evicted_blocks"] >= 4
    assert st["codec"] == "int8"
    assert get["ok"] == [True] * 4 and get["equal"] != [True] * 4
    assert 0 < get["max_abs_err"] < 0.1 * get["max_abs"]


def test_daemon_killed_mid_batch_is_misses_then_recovers(tmp_path) -> None:
    """SIGKILL the daemon while a batch is in flight: every call still returns a list of
    bools within its deadline, no page reported loaded holds wrong bytes, and once the daemon
    is back the same backend stores and loads again."""
    d = start_daemon(tmp_path)
    try:
        p = run(d.address, [
            {"op": "set", "seed": 31, "pages": 32},
            {"op": "chaos", "seed": 31, "pages": 32, "kill_pid": d.proc.pid, "after_calls": 4,
             "seconds": 3, "recover_s": 60},
        ], args=("--timeout-s", "2"), background=True)
        end = time.monotonic() + RUN_DEADLINE_S
        while d.alive() and p.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        assert not d.alive(), "the runner did not kill the daemon"
        d.restart()
        out, err = p.communicate(timeout=RUN_DEADLINE_S)
        r = result(p.returncode, out, err)
    finally:
        cleanup(d)
    chaos = r["steps"][1]
    print("chaos:", json.dumps(chaos))            # figures for the record (pytest -s)
    assert chaos["killed_in_call"] is True
    assert chaos["exceptions"] == 0 and chaos["wrong_pages"] == 0
    assert chaos["calls_after_kill"] >= 1 and chaos["failed_pages"] > 0
    assert chaos["max_call_s_after_kill"] < 2 * 2 + 5   # every RPC has a deadline (2 s here)
    assert chaos["recovered"] is True
    st = r["stats"]["layer_first"]
    assert st["pages_get_failed"] + st["pages_set_failed"] > 0   # counted, not raised


# -- identity, without SGLang --------------------------------------------------------------

class _Config:
    """The fields of SGLang's HiCacheStorageConfig that name a namespace."""

    def __init__(self, **kw: Any) -> None:
        self.tp_rank, self.tp_size, self.pp_rank, self.pp_size = 0, 1, 0, 1
        self.attn_cp_rank, self.attn_cp_size, self.dcp_rank, self.dcp_size = 0, 1, 0, 1
        self.is_mla_model, self.model_name, self.should_split_heads = False, "m", False
        self.__dict__.update(kw)


def _geo(layout: str = "layer_first", shape: tuple = (2, 4, 16, 2, 64)) -> PageGeometry:
    n = 1
    for s in shape:
        n *= s
    return PageGeometry("MHATokenToKVPoolHost", layout, 16, shape, "bfloat16", torch.bfloat16,
                        n * 2, "")


def _ns_digest(cfg: _Config, geo: PageGeometry, codec: str = "lossless") -> bytes:
    from kvstore_client.common.layout import NamespaceSpec
    a = identity.namespace_args(cfg, geo, codec=codec, tenant_salt="", scheme="external:sglang-x")
    return NamespaceSpec(**a).digest


def test_fold_key_uses_sha256_bytes_and_folds_anything_else() -> None:
    h = "ab" * 32
    assert identity.fold_key(h) == bytes.fromhex(h)
    other = identity.fold_key(h + ".mamba")
    assert len(other) == 32 and other != identity.fold_key(h)
    assert identity.fold_key("zz" * 32) != identity.fold_key("zy" * 32)


def test_namespace_folds_tp_pp_rank_except_for_mla() -> None:
    geo = _geo()
    r0, r1 = _ns_digest(_Config(tp_size=2), geo), _ns_digest(_Config(tp_rank=1, tp_size=2), geo)
    assert r0 != r1                                     # each TP rank holds its own heads
    assert _ns_digest(_Config(pp_size=2), geo) != _ns_digest(_Config(pp_rank=1, pp_size=2), geo)
    m0 = _ns_digest(_Config(tp_size=2, is_mla_model=True), geo)
    m1 = _ns_digest(_Config(tp_rank=1, tp_size=2, is_mla_model=True), geo)
    assert m0 == m1 != r0                               # MLA: one copy for every rank
    assert _ns_digest(_Config(), geo) != _ns_digest(_Config(model_name="other"), geo)
    assert _ns_digest(_Config(), geo) != _ns_digest(_Config(), _geo("page_first", (2, 16, 4, 2,
                                                                                   64)))


def test_lossy_codec_only_where_the_page_layout_is_declared() -> None:
    a = identity.namespace_args(_Config(), _geo(), codec="int8", tenant_salt="")
    lay: KVLayout = a["layout"]
    assert a["codec"] == "int8" and lay.kv_axes == "2LTHD"
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_tokens) == (4, 2, 64, 16)
    pf = identity.namespace_args(_Config(), _geo("page_first", (2, 16, 4, 2, 64)), codec="int8",
                                 tenant_salt="")
    assert pf["layout"].kv_axes == "2TLHD" and pf["layout"].num_layers == 4
    mla = identity.namespace_args(_Config(is_mla_model=True), _geo(), codec="int8",
                                  tenant_salt="")
    assert mla["codec"] == "lossless" and not mla["layout"].kv_axes
    plain = identity.namespace_args(_Config(), _geo(), codec="lossless", tenant_salt="")
    assert plain["codec"] == "lossless" and not plain["layout"].kv_axes
    assert plain["hash_scheme"].startswith("external:sglang-")


def test_declared_page_layout_is_accepted_and_quantized_by_the_daemon(daemon) -> None:
    """A layer-first MHA page declared as 2LTHD goes through the daemon's int8 codec: the
    daemon accepts the declaration, and the page comes back close to (not equal to) the
    original, with K and V of each head quantized separately."""
    geo = _geo()
    args = identity.namespace_args(_Config(model_name="lossy"), geo, codec="int8",
                                   tenant_salt="")
    page = torch.randn(geo.shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    src = page.view(torch.int16).numpy().reshape(-1).view(np.uint8)
    out = np.zeros(geo.nbytes, dtype=np.uint8)
    with connect(daemon.address) as c:
        ns = c.namespace(**args)
        key = identity.fold_key("cd" * 32)

        def fill(base, offsets, first) -> None:
            base[offsets[0]:offsets[0] + geo.nbytes] = src

        def drain(base, offsets, first) -> None:
            out[:] = base[offsets[0]:offsets[0] + geo.nbytes]
        assert ns.store_blocks([key], fill) == 1
        c.evict("host")                  # the int8 copy on SSD is what a later load reads
        assert ns.load_blocks([key], drain) == 1
    back = torch.from_numpy(out.view(np.int16).copy()).view(torch.bfloat16).view(geo.shape)
    err = (back.float() - page.float()).abs().max().item()
    assert 0 < err < 0.1 * page.float().abs().max().item()
