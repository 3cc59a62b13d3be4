"""Handlers of the bytes path: Put and Get stream block bytes through gRPC messages, for clients
that cannot map the daemon's pools (another host, a tenant without its own pool).

Put is a client stream: each message's blocks continue the prefix chain of the previous
message, and a block too big for one message (the receive limit is 4 MiB by default) arrives
alone, in pieces, each piece growing the block only as its bytes arrive (kvstore.proto,
PutRequest). Its messages are parsed by kvstore/put_wire.py, which refuses as it reads, and
stored a group of messages at a time (kvstore/put_groups.py), while the next ones are received
on a thread of their own (kvstore_client/common/read_ahead.py). A message may carry its
blocks' token ids (a split block's on its first message), which the store keeps for the KV
events of the blocks it publishes, as Commit's (kvstore/events/).

Get is a server stream of the longest cached prefix in batches of about GET_BATCH_BYTES, each
block copied out of the host pool and checked against its commit checksum in one pass, the
next batch built while the previous one is sent (kvstore/getcopy.py).

Both hold heap for as long as the client takes to send or read, so both charge a per-tenant
budget of stream bytes (limits.stream_bytes_per_tenant, kvstore/stream_budget.py): a split block
is charged whole when its first piece arrives (refused RESOURCE_EXHAUSTED at once past the
budget), a Get batch twice its block bytes (the daemon's message and grpc's copy of it) until
it is sent. Without it a tenant's stalled calls held up to three blocks each of heap (16
never-read Gets of 32 MiB blocks: 1.6 GB), whatever its quota.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client.common.errors import InvalidArgument
from kvstore_client.common.read_ahead import ReadAhead

from .. import gate, getcopy
from ..put_groups import PutGroups
from ..put_wire import check_token_ids, parse_put
from ..stream_budget import PutCharges, StreamBudget, Tab
from .state import CallState
from .validate import check_keys, check_ns, check_parent, parse_request

GET_BATCH_BYTES = 4 << 20     # block bytes per Get stream message
GET_COPIES = 2                # a Get message in flight: the daemon's bytes and grpc's copy
PUT_READ_AHEAD = 2            # Put messages received ahead of the one being stored


class StreamCalls:
    def __init__(self, state: CallState) -> None:
        self.s = state
        self._pool_lock = threading.Lock()
        self._reader: ThreadPoolExecutor | None = None   # Get's read-ahead (getcopy.stream)
        limits = getattr(getattr(state.store, "config", None), "limits", None)
        self._budget = StreamBudget(
            limits.stream_bytes_per_tenant if limits is not None else 0)
        self._deadline_s = limits.request_deadline_s if limits is not None else 30.0

    def _tab(self) -> Tab:
        """This call's account with the tenant's stream budget (deadline: the call's own)."""
        caller = self.s.auth.caller
        return Tab(self._budget, caller.name if caller is not None else None,
                           time.monotonic() + self._deadline_s)

    def Put(self, raws: Iterator[bytes]) -> pb.PutResponse:
        """Client stream: each message's blocks continue the chain of the previous message; a
        block too big for one message arrives alone, in pieces (kvstore.proto, PutRequest).

        Blocks are stored a group of messages at a time (kvstore/put_groups.py) while the next
        messages are received on a thread of their own (read_ahead.py); what was received
        before an error is stored before the error is reported."""
        groups = PutGroups(self.s.store)
        tab = self._tab()
        charges = PutCharges(tab)       # every message received, until its blocks are stored
        received = ReadAhead(charges.arriving(raws), PUT_READ_AHEAD, name="kvstore-put-read",
                             inline=1)
        try:
            self._put_messages(received, groups, tab, charges)
        except Exception:
            groups.flush_before_error()
            raise
        finally:
            received.close()
            charges.close()
            tab.give(charges.extra)
        groups.flush()
        return pb.PutResponse(stored=groups.stored, duplicates=groups.duplicates)

    def _put_messages(self, raws: Iterable[bytes], groups: PutGroups, tab: Tab,
                      charges: PutCharges) -> None:
        """Parse and check each message (kvstore/put_wire.py), handing its blocks to `groups`.

        Each message stays charged to the tenant's stream budget until the group holding its
        blocks is stored (stream_budget.PutCharges). A split block is charged whole when its
        first piece arrives, and given back once complete: refused there, before its buffer
        grows, since a client that never sends the rest would hold it until the call's
        deadline; its pieces are given back as they are copied into it."""
        s = self.s
        ns: bytes | None = None
        prev: bytes | None = None      # parent of the next block
        block_bytes: int | None = None
        block_tokens = 0               # the namespace's, read at the first token ids
        # (key, bytes so far, message, its token ids) of the block split across messages
        split: tuple[bytes, bytearray, int, bytes] | None = None

        def sizer(ns_id: bytes) -> int | None:
            s.auth.check_ns(check_ns(ns_id, "namespace_id (first Put message)"))
            return s.block_bytes(ns_id)
        for m, raw in enumerate(raws):
            need = block_bytes - len(split[1]) if split is not None and block_bytes else 0
            msg = parse_put(raw, block_bytes, sizer if m == 0 else None, f"message {m}", need)
            if m == 0:
                ns = check_ns(msg.ns, "namespace_id (first Put message)")
                s.auth.check_ns(ns)
                prev = check_parent(msg.parent, "parent (first Put message)")
                block_bytes = s.block_bytes(ns)
                groups.start(ns, prev)
            else:
                if msg.ns and msg.ns != ns:
                    raise InvalidArgument(f"Put message {m} names another namespace; one Put "
                                          "stream writes one namespace")
                if msg.parent and msg.parent != prev:
                    raise InvalidArgument(f"Put message {m}: parent must be empty (the chain "
                                          "continues from the previous message's last key)")
            blocks, tokens = msg.blocks, msg.token_ids
            if tokens and not block_tokens:
                block_tokens = s.store.namespace(ns).spec.layout.block_tokens
            if msg.piece is not None:
                key, data = msg.piece
                if split is None:               # a split block begins
                    if not key:
                        raise InvalidArgument(f"message {m} blocks[0] has no key, and no split "
                                              "block is open for it to continue")
                    if block_bytes is None:
                        raise InvalidArgument(f"message {m} blocks[0].data is {len(data)} "
                                              "bytes; a namespace's blocks have one size")
                    check_token_ids(f"message {m}", tokens, 1, block_tokens)
                    # The block's charge stands for its pieces: this message's goes first.
                    charges.copied(m)
                    if not tab.try_take(block_bytes, charges.own()):
                        raise tab.budget.exhausted(tab.who, block_bytes,
                                                   f"Put message {m} (a split block)")
                    charges.extra = block_bytes
                    split = (key, bytearray(data), m, tokens)
                else:                           # grows only as its bytes arrive
                    if tokens:
                        raise InvalidArgument(f"message {m} continues a split block: its "
                                              "token_ids go on the block's first message "
                                              f"(message {split[2]}), with its key")
                    split[1].extend(data)
                    charges.copied(m)           # (the piece is in the block's own buffer)
                if block_bytes is None or len(split[1]) < block_bytes:
                    continue
                blocks, tokens = [(split[0], memoryview(split[1]))], split[3]
                split = None
                tab.give(charges.extra)   # complete: the group stores it within GROUP_BYTES
                charges.extra = 0
            else:
                check_token_ids(f"message {m}", tokens, len(blocks), block_tokens)
            if not blocks:
                continue
            keys = check_keys((k for k, _ in blocks), f"message {m} blocks[].key",
                              distinct=True)
            groups.add(keys, [d for _, d in blocks], tokens or None)
            if not groups.empty and tab.budget.pressed(tab.who):
                groups.flush()          # many Puts at once: store, and give the room back
            if groups.empty:
                charges.stored(m)
            prev = keys[-1]
        gate.received()
        if split is not None:
            raise InvalidArgument(f"message {split[2]} blocks[0].data is {len(split[1])} "
                                  f"bytes; this namespace's blocks are {block_bytes} bytes, and "
                                  "the stream ended before the rest of that block arrived")

    def Get(self, raw: bytes) -> Iterator[bytes | pb.GetResponse]:
        """The longest cached prefix, fetched and sent in ~GET_BATCH_BYTES messages to bound
        memory."""
        s = self.s
        req = parse_request(pb.GetRequest, raw, distinct_keys=True)
        ns = check_ns(req.namespace_id)
        s.auth.check_ns(ns)
        keys = check_keys(req.keys, distinct=True)
        bb = s.block_bytes(ns)
        per = max(1, GET_BATCH_BYTES // bb) if bb else 1
        sent = False
        for msg in self._get_batches(ns, keys, per, s.store.config.host.verify_reads, bb):
            sent = True
            yield msg
        if not sent:
            yield pb.GetResponse()

    def _get_batches(self, ns: bytes, keys: list[bytes], per: int, check: bool,
                     bb: int | None = None) -> Iterator[bytes]:
        """Encoded GetResponses of the longest cached prefix, each block's copy checked against
        its commit checksum (kvstore/getcopy.py); a block that fails ends the stream there."""
        store = self.s.store

        def read(chunk: list[bytes]) -> getcopy.Reply:
            return store.read_prefix(
                ns, chunk, lambda views, sums: getcopy.encode(views, sums, check))

        def report(key: bytes) -> None:
            store.corrupt_host_copy(ns, key, "Get")
        return getcopy.stream(read, keys, per, report,
                              self._read_pool() if len(keys) > per else None,
                              self._tab(), GET_COPIES * (bb or 0))

    def _read_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._reader is None:
                self._reader = ThreadPoolExecutor(2, thread_name_prefix="get-read")
            return self._reader
