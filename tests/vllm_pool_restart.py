"""Runs under the vLLM environment (`.venv-vllm`), never under pytest; driven by
tests/test_pool_restart.py, which SIGKILLs and restarts the daemon when this prints RESTART and
answers with a line on stdin.

Three engines of one tenant with its own host pool (a memfd), through vLLM's own tiering
manager and kvstore's tier (tests/vllm_manager.py's Engine): A stores, B loads; after the
restart C stores other chunks, then A's again; B, which never stores, promotes them. Writes what
B saw and what the daemon holds to the file named by the second argument, then closes every
engine (the driver checks that vLLM closed its primary tiers' mmaps).

    python tests/vllm_pool_restart.py unix:/path/kvs.sock OUT
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any


def _jobs(e: Any, since: int) -> list[dict[str, Any]]:
    return [{k: j[k] for k in ("success", "successful_keys")} for j in e.jobs[since:]]


def main() -> None:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    from tests import vllm_manager as vm

    kcu.init_none_hash(get_hash_fn_by_name("sha256"))     # what the engine core does
    address, out = sys.argv[1], sys.argv[2]
    keys, data = vm.prompt(31, 4)
    a, b = vm.Engine(address), vm.Engine(address)
    engines = [a, b]
    result: dict[str, Any] = {}
    try:
        a.store(keys, data)
        a.settle()
        seen = b.lookup_until(keys, 10.0)
        result["before"] = {"answers": seen["answers"],
                            "bytes_equal": b.read(keys) == [data[k] for k in keys]}
        result["fd_backed"] = bool(b.tier._client.pool.fd_backed)
        vm.evict_primary(b, 301)            # so that B must promote the chunks again
        print("RESTART", flush=True)
        sys.stdin.readline()
        c = vm.Engine(address)
        engines.append(c)
        other, odata = vm.prompt(32, 3)     # the new run's slots for `keys` lie elsewhere
        c.store(other, odata)
        c.settle()
        c.store(keys, data)
        c.settle()
        result["held_before"] = vm._locate(c, keys)
        client = b.tier._client
        resyncs, jobs = client.counters["resyncs"], len(b.jobs)
        seen = b.lookup_until(keys, 10.0)
        hits = [k for k, s in zip(keys, seen["first_s"], strict=True) if s is not None]
        result["after"] = {
            "answers": seen["answers"], "jobs": _jobs(b, jobs),
            "bytes_equal": len(hits) == len(keys) and b.read(keys) == [data[k] for k in keys],
            "corrupt_dropped": b.stats()["corrupt_dropped"],
            "resyncs": client.counters["resyncs"] - resyncs}
        result["held_after"] = vm._locate(c, keys)
    except Exception:
        result["error"] = traceback.format_exc()
    result["exceptions"] = [x for e in engines for x in e.exceptions]
    if "error" in result:
        result["exceptions"].append(result.pop("error"))
    with open(out, "w") as f:
        json.dump(result, f, default=str)
    for e in engines:
        e.close()
    print("closed", flush=True)
    sys.stderr.flush()
    os._exit(0)     # skip vLLM's slow interpreter teardown; the mmaps were closed above


if __name__ == "__main__":
    main()
