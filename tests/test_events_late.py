"""A vLLM block stored before its engine's events named it waits for them, and is announced
when they come (kvstore/events/pending.py), not only at a stream's next start-over.

tests/test_events.py's relay test stores a block before the engine's events too, but while
the stream has not started yet: the start-over and the replayed change name it there, so a
publisher that never announced a waiting block would pass it. Here the stream has started and
the block is waiting before the engine speaks. A real store relaying a fake vLLM engine
(tests/test_events.py), with a subscriber of the merged stream.
"""

from __future__ import annotations

import time

from tests.events_helpers import DEADLINE_S, firsts, held, stored
from tests.test_events import T, _vllm_hashes, put_raw, relayed


def test_a_block_stored_before_its_engines_events_is_announced_when_they_come(tmp_path):
    from kvstore_client.vllm.keyspace import fold_key
    with relayed(tmp_path) as (engine, store, sub, ns):
        pub = store.events.publisher
        hs = _vllm_hashes(2, 7)             # one offload chunk of 2 engine blocks
        u = [int.from_bytes(h, "big") & (2**64 - 1) for h in hs]
        toks = list(range(300, 300 + 2 * T))
        key = fold_key(hs[1] + bytes(4))
        sub.wait(lambda e: any(x["type"] == "AllBlocksCleared" for x in e),
                 what="the stream's first announcement")
        put_raw(store, ns, [key])
        end = time.monotonic() + DEADLINE_S
        while ns + key not in pub.pending.blocks:
            assert time.monotonic() < end, "the block never waited for its engine's events"
            time.sleep(0.01)
        walks = pub.counters["events_start_overs"] + pub.counters["events_reannouncements"]
        engine.send([{"type": "BlockStored", "block_hashes": hs, "parent_block_hash": None,
                      "token_ids": toks, "block_size": T, "lora_id": None,
                      "medium": "GPU", "lora_name": None}])
        evs = sub.wait(lambda e: "CPU" in held(e), what="the waiting block announced")
        assert firsts(stored(evs, "CPU")) == [
            {"type": "BlockStored", "block_hashes": [u[i]], "parent_block_hash": [None, u[0]][i],
             "token_ids": toks[i * T:(i + 1) * T], "block_size": T, "lora_id": None,
             "medium": "CPU", "lora_name": None} for i in range(2)]
        # announced by the engine's events, not by a walk of the index
        assert pub.counters["events_start_overs"] + pub.counters["events_reannouncements"] \
            == walks
        assert ns + key not in pub.pending.blocks
