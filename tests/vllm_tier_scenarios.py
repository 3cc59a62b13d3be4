"""What kvstore's vLLM tier promises about identity, events and engine signals, through vLLM.

Runs under a vLLM environment (never under pytest), like tests/vllm_manager.py, whose `Engine`
(vLLM's own TieringOffloadingSpec and TieringOffloadingManager with KVStoreTier loaded by vLLM's
tier factory) it reuses; tests/test_vllm_tier.py starts it against a real daemon and checks the
JSON it prints as its last line.

    python tests/vllm_tier_scenarios.py --address unix:/path/kvs.sock --only a,b --out FILE

Scenarios: `parallel` (which parallel layouts share chunks), `namespaces` (PP, dtype,
tenant_salt), `cache_salt` (vLLM's own request hashing), `events` (vLLM's KV events),
`signals` (retention hints from request ends and preemptions; run against a daemon whose host
tier evicts by LRU), `geometry` (a chunk size that cannot be right is refused).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from typing import Any
from unittest import mock

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.vllm_manager import (  # noqa: E402
    BLOCK_TOKENS,
    CHUNK_BYTES,
    Capture,
    Engine,
    daemon_client,
    prompt,
)

TP2 = {"tp_size": 2, "world_size": 2}
TP4 = {"tp_size": 4, "world_size": 4, "rank": 0}


def _ns(e: Engine) -> str:
    return e.tier._namespace().ns_id.hex()


def _where(client: Any, e: Engine, keys: list[bytes]) -> list[str | None]:
    from kvstore_client.vllm.keyspace import fold_key
    return e.tier._namespace().locate([fold_key(k) for k in keys])


def _share(address: str, seed: int, writer: dict[str, Any], reader: dict[str, Any],
           shared: bool) -> dict[str, Any]:
    """Writer stores a prompt; a reader of another layout looks it up (until every chunk
    answers HIT, or MISS where none is expected) and reads what it found."""
    keys, data = prompt(seed, 3)
    w, r = Engine(address, **writer), Engine(address, **reader)
    try:
        w.store(keys, data)
        w.settle()
        seen = r.lookup_until(keys, 30.0, stop="HIT" if shared else "MISS")
        hits = all(a[-1] == "HIT" for a in seen["answers"])
        got = r.read(keys) if hits else []
        return {"same_namespace": _ns(w) == _ns(r), "answers": seen["answers"], "hit": hits,
                "bytes_equal": hits and got == [data[k] for k in keys],
                "writer_layout": w.tier._namespace().spec.layout.engine_layout,
                "exceptions": w.exceptions + r.exceptions}
    finally:
        w.close()
        r.close()


def sc_parallel(args: argparse.Namespace) -> dict[str, Any]:
    """Replicated (MLA) chunks and canonical topology-free pages are shared across TP sizes;
    the direct layout's are not, even where vLLM calls the configuration parallel-agnostic."""
    agnostic = {"is_parallelism_agnostic": True}
    canonical = {"canonical_layout": True, "kv_cache_layout": "LBNHC"}
    return {
        "replicated": _share(args.address, 61, {"parallel": TP2,
                                                "config": {"replicated_layout": True}},
                             {"parallel": TP4, "config": {"replicated_layout": True}}, True),
        "mha_direct": _share(args.address, 62, {"parallel": TP2}, {"parallel": TP4}, False),
        "mha_direct_agnostic": _share(args.address, 63, {"parallel": {**TP2, **agnostic}},
                                      {"parallel": {**TP4, **agnostic}}, False),
        "mha_canonical": _share(args.address, 64, {"parallel": {**TP2, **agnostic},
                                                   "config": canonical},
                                {"parallel": {**TP4, **agnostic}, "config": canonical}, True),
        "mha_same_tp": _share(args.address, 65, {"parallel": TP2}, {"parallel": TP2}, True),
    }


def sc_namespaces(args: argparse.Namespace) -> dict[str, Any]:
    """One field apart, one namespace apart: PP size, cache dtype, tenant salt."""
    def ns_of(**kw: Any) -> str:
        e = Engine(args.address, **kw)
        try:
            return _ns(e)
        finally:
            e.close()
    base = ns_of()
    salted = _share(args.address, 66, {"tenant_salt": "tenant-a"}, {"tenant_salt": "tenant-b"},
                    False)
    same_salt = _share(args.address, 67, {"tenant_salt": "tenant-a"},
                       {"tenant_salt": "tenant-a"}, True)
    return {"base": base, "base_again": ns_of(),
            "pp2": ns_of(parallel={"pp_size": 2, "world_size": 2}),
            "float16": ns_of(dtype="float16"), "bfloat16": ns_of(dtype="bfloat16"),
            "salt_a": ns_of(tenant_salt="tenant-a"), "salt_b": ns_of(tenant_salt="tenant-b"),
            "other_salt_share": salted, "same_salt_share": same_salt}


def _request_keys(tokens: list[int], cache_salt: str | None, rid: str) -> list[bytes]:
    """vLLM's own offload keys for a request: its Request and block hasher, salt and all."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.kv_offload.base import make_offload_key
    from vllm.v1.request import Request

    req = Request(rid, tokens, SamplingParams(max_tokens=1), None, cache_salt=cache_salt,
                  block_hasher=get_request_block_hasher(BLOCK_TOKENS,
                                                        get_hash_fn_by_name("sha256")))
    return [make_offload_key(bytes(h), 0) for h in req.block_hashes]


def sc_cache_salt(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM folds a request's cache_salt into its block hashes: salted requests never meet
    unsalted ones (or other salts) in kvstore, and meet requests with the same salt."""
    rng = np.random.default_rng(71)
    tokens = [int(t) for t in rng.integers(3, 8000, 3 * BLOCK_TOKENS)]
    plain = _request_keys(tokens, None, "plain")
    salt1 = _request_keys(tokens, "salt-1", "s1")
    salt1b = _request_keys(tokens, "salt-1", "s1b")
    salt2 = _request_keys(tokens, "salt-2", "s2")
    data = {k: rng.integers(0, 256, CHUNK_BYTES, dtype=np.uint8).tobytes()
            for k in plain + salt1}
    a, b = Engine(args.address), Engine(args.address)
    try:
        a.store(plain, data)
        a.store(salt1, data)
        a.settle()
        other = b.lookup_until(salt2, 30.0, stop="MISS")
        same = b.lookup_until(salt1b, 30.0)
        got = b.read(salt1b) if all(s is not None for s in same["first_s"]) else []
        return {"keys_differ": len({*plain, *salt1, *salt2}) == 3 * len(plain),
                "same_salt_same_keys": salt1 == salt1b, "other_salt": other["answers"],
                "same_salt": same["answers"], "same_bytes": got == [data[k] for k in salt1],
                "exceptions": a.exceptions + b.exceptions}
    finally:
        a.close()
        b.close()


def _standalone_tier(e: Engine, **settings: Any) -> Any:
    """A KVStoreTier built by vLLM's factory over a primary view of its own (as vLLM's tests
    build tiers), so jobs can be submitted without the manager."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    stride = e.view.shape[1]
    buf = np.zeros((4, stride), dtype=np.uint8)
    cfg = {"type": "KVStoreTier", "module_path": "kvstore_client.vllm.tier", **settings}
    return SecondaryTierFactory.create_secondary_tier(cfg, memoryview(buf), e.spec), buf


def _job(job_id: int, keys: list[bytes], chunks: list[int], promotion: bool) -> Any:
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array(chunks, dtype=np.int64),
                       is_promotion=promotion, req_context=ReqContext(req_id=f"job{job_id}"))


def _event(ev: Any) -> dict[str, Any]:
    return {"keys": [bytes(k).hex() for k in ev.keys], "medium": ev.medium.value,
            "removed": bool(ev.removed),
            "locality": ev.locality.value if ev.locality is not None else None}


def sc_events(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's KV events: one stored event per successful store job (through vLLM's manager
    too), none for failed jobs or loads; a removed event for announced chunks the tier finds
    gone (a load or a lookup misses them); nothing unless vLLM's KV events are on."""
    from kvstore_client.vllm.keyspace import fold_key
    from vllm.v1.kv_offload.base import ReqContext

    out: dict[str, Any] = {}
    on = {"enable_kv_cache_events": True}
    e = Engine(args.address, config=on, enable_kv_events=True, locality="LOCAL")
    try:
        keys, data = prompt(81, 3)
        e.store(keys, data)
        e.settle()
        out["through_manager"] = [_event(v) for v in e.mgr.take_events()]
        out["stored_keys"] = [bytes(k).hex() for k in keys]
        tier, buf = _standalone_tier(e, address=args.address, enable_kv_events=True,
                                     locality="LOCAL", hit_ttl_s=0.0)
        k1, _ = prompt(82, 2)
        k2, _ = prompt(83, 2)
        tier.submit_store(_job(1, k1, [0, 99], False))       # a chunk outside the primary tier
        tier.submit_store(_job(2, k2, [0, 1], False))
        tier.drain_jobs()
        out["jobs"] = {r.job_id: r.success for r in tier.get_finished_jobs()}
        out["after_stores"] = [_event(v) for v in tier.take_events()]
        tier.submit_load(_job(3, k2, [2, 3], True))
        tier.drain_jobs()
        out["load_ok"] = [r.success for r in tier.get_finished_jobs()]
        out["after_load"] = [_event(v) for v in tier.take_events()]
        ns = tier._namespace()
        ns.delete([fold_key(k2[1])])         # evicted or deleted behind the tier's back
        tier.submit_load(_job(4, k2, [2, 3], True))
        tier.drain_jobs()
        out["missing_load"] = [(r.success, None if r.successful_keys is None else
                                [bytes(k).hex() for k in r.successful_keys])
                               for r in tier.get_finished_jobs()]
        out["after_missing_load"] = [_event(v) for v in tier.take_events()]
        ns.delete([fold_key(k2[0])])
        ctx = ReqContext(req_id="again")
        answers = []
        end = time.monotonic() + 10.0
        while time.monotonic() < end:
            answers.append(tier.lookup(k2[0], ctx).name)
            if answers[-1] == "MISS":
                break
            time.sleep(0.01)
        out["lookup_after_delete"] = answers[-1]
        out["after_lookup"] = [_event(v) for v in tier.take_events()]
        out["k2"] = [bytes(k).hex() for k in k2]
        tier.shutdown()
        del buf
        out["exceptions"] = e.exceptions
    finally:
        e.close()
    cap = Capture()
    logging.getLogger("kvstore.vllm").addHandler(cap)
    off = Engine(args.address, enable_kv_events=True)     # vLLM's KV events are off
    try:
        keys, data = prompt(84, 2)
        off.store(keys, data)
        off.settle()
        out["off_events"] = [_event(v) for v in off.tier.take_events()]
        out["off_warnings"] = [w for w in cap.lines(logging.WARNING) if "events" in w]
    finally:
        logging.getLogger("kvstore.vllm").removeHandler(cap)
        off.close()
    return out


def _store_open(e: Engine, keys: list[bytes], data: dict[bytes, bytes], **params: Any) -> Any:
    """Store a request's chunks and leave the request open (not finished yet)."""
    from vllm.v1.kv_offload.base import ReqContext
    e._req += 1
    c = ReqContext(req_id=f"{e.name}-r{e._req}", kv_transfer_params=params or None)
    e.mgr.on_new_request(c)
    out = e.mgr.prepare_store(keys, c)
    for k, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
        e.view[int(chunk), :CHUNK_BYTES] = np.frombuffer(data[k], np.uint8)
    e.mgr.complete_store(out.keys_to_store, c)
    e.step()
    e.settle()
    return c


def sc_signals(args: argparse.Namespace) -> dict[str, Any]:
    """A finished request's `kvstore_session` and a preemption reach the daemon's eviction
    order as retention hints: closed -> evicted first, continues / preempted -> kept like
    recently used, nothing said -> no hint. One-chunk requests, so every block is a leaf."""
    from vllm.v1.kv_offload.base import ScheduleEndContext

    client = daemon_client(args.address)
    e = Engine(args.address)
    try:
        def hints() -> int:
            return int(client.stats()["counters"].get("retention_hint_blocks", 0))
        client.evict("host")                    # only this scenario's blocks in host memory
        base = hints()
        (c_key,), c_data = prompt(91, 1)        # continues: stored first (oldest)
        (d_key,), d_data = prompt(92, 1)        # preempted
        (b_key,), b_data = prompt(93, 1)        # finished, nothing said
        (a_key,), a_data = prompt(94, 1)        # closed: stored last (newest)
        c_ctx = _store_open(e, [c_key], c_data, kvstore_session="continues")
        d_ctx = _store_open(e, [d_key], d_data)
        b_ctx = _store_open(e, [b_key], b_data)
        e.mgr.on_request_finished(b_ctx)
        a_ctx = _store_open(e, [a_key], a_data, kvstore_session="closed")
        e.mgr.on_request_finished(a_ctx)
        e.mgr.on_request_finished(c_ctx)
        e.mgr.on_schedule_end(ScheduleEndContext(new_req_ids=(),
                                                 preempted_req_ids=(d_ctx.req_id,)))
        e.mgr.on_request_finished(d_ctx)
        e.settle()
        end = time.monotonic() + 20.0
        while hints() < base + 3 and time.monotonic() < end:
            time.sleep(0.02)
        e.settle()
        sent = hints() - base
        order = []
        keys = {"closed": a_key, "plain": b_key, "continues": c_key, "preempted": d_key}
        for _ in range(4):
            client.evict("host", 1)
            where = dict(zip(keys, _where(client, e, list(keys.values())), strict=True))
            order.extend(n for n, w in where.items() if w != "host" and n not in order)
        return {"hints_sent": sent, "eviction_order": order, "exceptions": e.exceptions}
    finally:
        client.close()
        e.close()


def sc_geometry(args: argparse.Namespace) -> dict[str, Any]:
    """Chunk sizes that cannot be right are refused at construction with one line: a chunk
    larger than the primary tier's rows, a size that is not an integer (a mock's)."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    e = Engine(args.address)
    cfg = {"type": "KVStoreTier", "module_path": "kvstore_client.vllm.tier",
           "address": args.address}
    out: dict[str, Any] = {}
    try:
        small = np.zeros((4, 4096), dtype=np.uint8)          # rows shorter than a chunk
        mocked = mock.MagicMock()
        mocked.config = mock.MagicMock()                        # every size a MagicMock
        for name, view, spec in (("chunk_larger_than_row", small, e.spec),
                                 ("not_an_integer", e.view, mocked)):
            try:
                SecondaryTierFactory.create_secondary_tier(cfg, memoryview(view), spec)
                out[name] = None
            except ValueError as err:
                out[name] = f"{type(err).__name__}: {err}"
    finally:
        e.close()
    return out


SCENARIOS = {"parallel": sc_parallel, "namespaces": sc_namespaces, "cache_salt": sc_cache_salt,
             "events": sc_events, "signals": sc_signals, "geometry": sc_geometry}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--out", default="")
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    args = ap.parse_args()

    from kvstore_client.vllm.compat import check_vllm
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    result: dict[str, Any] = {"vllm": check_vllm(), "scenarios": {}, "errors": {}}
    kcu.init_none_hash(get_hash_fn_by_name("sha256"))     # what the engine core does
    only = [s for s in args.only.split(",") if s]
    for name, fn in SCENARIOS.items():
        if only and name not in only:
            continue
        t0 = time.monotonic()
        try:
            result["scenarios"][name] = fn(args)
        except Exception:
            result["errors"][name] = traceback.format_exc()
        print(f"scenario {name}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    text = json.dumps(result, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text, flush=True)
    os._exit(0)   # skip vLLM's slow interpreter teardown; the output is written


if __name__ == "__main__":
    main()
