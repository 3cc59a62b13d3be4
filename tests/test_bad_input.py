"""Every RPC fed bad input answers with its documented status, never INTERNAL or UNKNOWN, and
nothing stored changes.

One daemon serves the whole module: blocks are stored and checksummed first, the fuzzing runs,
and the last test reads the blocks back and compares (pytest runs a module's tests in order).
"""

from __future__ import annotations

import math

import grpc
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client._proto import kvstore_pb2_grpc as pb_grpc
from kvstore_client.common.limits import MAX_CARRIED_RELEASES

from tests.daemon import cleanup, start_daemon
from tests.test_server import SMALL_BYTES, blocks, chain, get, put, register

OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
EXPIRED = grpc.StatusCode.FAILED_PRECONDITION
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
# Statuses a client may legitimately get for garbage (anything but a daemon bug).
DOCUMENTED = {OK, INVALID, NOT_FOUND, EXPIRED, EXHAUSTED, grpc.StatusCode.DATA_LOSS,
              grpc.StatusCode.UNAVAILABLE}
FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
METHODS = {
    "RegisterNamespace": "unary_unary", "Lookup": "unary_unary", "Reserve": "unary_unary",
    "Commit": "unary_unary", "Acquire": "unary_unary", "Release": "unary_unary",
    "RenewLease": "unary_unary", "Put": "stream_unary", "Get": "unary_stream",
    "Retain": "unary_unary", "Delete": "unary_unary", "Evict": "unary_unary",
    "Flush": "unary_unary",
    "Stats": "unary_unary",
}
N_STORED = 8


class World:
    """The module's daemon, a stub, and what was stored before the fuzzing started."""

    def __init__(self, d) -> None:
        self.d = d
        self.channel = d.channel()
        self.stub = pb_grpc.KVStoreStub(self.channel)
        self.ns = register(self.stub).namespace_id
        self.keys = chain(N_STORED, 42)
        self.data = blocks(N_STORED, SMALL_BYTES, 42)
        self.sums = [xxhash.xxh3_64_intdigest(b) for b in self.data]
        assert put(self.stub, self.ns, self.keys, self.data).stored == N_STORED


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("fuzz"))
    try:
        w = World(d)
        yield w
        w.channel.close()
    finally:
        cleanup(d)


def status(call, request, **kw) -> grpc.StatusCode:
    """The status code of one call (OK when it succeeds); streams are drained."""
    try:
        out = call(request, timeout=10, **kw)
        if hasattr(out, "__iter__") and not hasattr(out, "SerializeToString"):
            for _ in out:
                pass
        return OK
    except grpc.RpcError as e:
        return e.code()


def expect(code: grpc.StatusCode, allowed: set | grpc.StatusCode) -> None:
    allowed = allowed if isinstance(allowed, set) else {allowed}
    assert code in allowed, f"got {code}, expected one of {allowed}"


# ------------------------------------------------------------------------------ strategies

bad_key = st.one_of(st.binary(max_size=15), st.binary(min_size=33, max_size=80))
good_key = st.binary(min_size=16, max_size=32)
bad_ns = st.binary(max_size=40).filter(lambda b: len(b) != 16)
unknown_ns = st.binary(min_size=16, max_size=16)
lease_id = st.text(min_size=1, max_size=200)
bad_ttl = st.one_of(st.floats(max_value=-1e-9, allow_nan=False), st.just(math.nan),
                    st.just(math.inf), st.floats(min_value=601.0, allow_infinity=False))
bad_tier = st.text(max_size=20).filter(lambda t: t not in ("", "host", "gpu", "ssd", "remote"))


def keys_with_a_bad_one(draw_keys=st.lists(good_key, max_size=5)):
    return st.tuples(draw_keys, bad_key, draw_keys).map(lambda t: [*t[0], t[1], *t[2]])


# ------------------------------------------------------------------------------ per RPC

@FUZZ
@given(keys=keys_with_a_bad_one())
def test_wrong_key_lengths(world, keys):
    s, ns = world.stub, world.ns
    expect(status(s.Lookup, pb.LookupRequest(namespace_id=ns, keys=keys)), INVALID)
    expect(status(s.Acquire, pb.AcquireRequest(namespace_id=ns, keys=keys)), INVALID)
    expect(status(s.Get, pb.GetRequest(namespace_id=ns, keys=keys)), INVALID)
    expect(status(s.Delete, pb.DeleteRequest(namespace_id=ns, keys=keys)), INVALID)
    expect(status(s.Put, iter([pb.PutRequest(
        namespace_id=ns, blocks=[pb.Block(key=k, data=bytes(SMALL_BYTES)) for k in keys])])),
        INVALID)


@FUZZ
@given(parent=bad_key.filter(len))
def test_wrong_parent_lengths(world, parent):
    s = world.stub
    expect(status(s.Put, iter([pb.PutRequest(namespace_id=world.ns, parent=parent, blocks=[
        pb.Block(key=chain(1, 7)[0], data=bytes(SMALL_BYTES))])])), INVALID)
    expect(status(s.Commit, pb.CommitRequest(lease_id="x" * 32, keys=world.keys[:1],
                                             parent=parent)), INVALID)


@FUZZ
@given(ns=bad_ns, unknown=unknown_ns)
def test_bad_and_unknown_namespaces(world, ns, unknown):
    s, keys = world.stub, world.keys[:2]
    for nsid, code in ((ns, INVALID), (unknown, NOT_FOUND)):
        expect(status(s.Lookup, pb.LookupRequest(namespace_id=nsid, keys=keys)), code)
        expect(status(s.Reserve, pb.ReserveRequest(namespace_id=nsid, count=1)), code)
        expect(status(s.Acquire, pb.AcquireRequest(namespace_id=nsid, keys=keys)), code)
        expect(status(s.Get, pb.GetRequest(namespace_id=nsid, keys=keys)), code)
        expect(status(s.Delete, pb.DeleteRequest(namespace_id=nsid, all=True)), code)
        expect(status(s.Put, iter([pb.PutRequest(namespace_id=nsid, blocks=[
            pb.Block(key=keys[0], data=bytes(SMALL_BYTES))])])), code)


@FUZZ
@given(lid=lease_id, ttl=st.floats(min_value=0, max_value=600))
def test_unknown_leases(world, lid, ttl):
    s = world.stub
    for call, req in ((s.Release, pb.ReleaseRequest(lease_id=lid)),
                      (s.RenewLease, pb.RenewLeaseRequest(lease_id=lid, ttl_s=ttl)),
                      (s.Commit, pb.CommitRequest(lease_id=lid, keys=world.keys[:1]))):
        expect(status(call, req), {NOT_FOUND, EXPIRED, INVALID})
    for call, req in ((s.Release, pb.ReleaseRequest()), (s.RenewLease, pb.RenewLeaseRequest()),
                      (s.Commit, pb.CommitRequest(keys=world.keys[:1]))):
        expect(status(call, req), INVALID)


@FUZZ
@given(count=st.one_of(st.just(0), st.integers(min_value=(1 << 16) + 1,
                                                max_value=(1 << 32) - 1)))
def test_zero_and_huge_counts(world, count):
    expect(status(world.stub.Reserve, pb.ReserveRequest(namespace_id=world.ns, count=count)),
           INVALID)


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(count=st.integers(min_value=4096 + 1, max_value=1 << 16))
def test_counts_above_the_pool(world, count):
    """More blocks than the 64 MiB pool holds: RESOURCE_EXHAUSTED, nothing evicted for it."""
    expect(status(world.stub.Reserve, pb.ReserveRequest(namespace_id=world.ns, count=count)),
           EXHAUSTED)


@FUZZ
@given(ttl=bad_ttl, tier=bad_tier)
def test_bad_ttls_and_tiers(world, ttl, tier):
    s, ns, keys = world.stub, world.ns, world.keys[:1]
    expect(status(s.Reserve, pb.ReserveRequest(namespace_id=ns, count=1, ttl_s=ttl)), INVALID)
    expect(status(s.Acquire, pb.AcquireRequest(namespace_id=ns, keys=keys, ttl_s=ttl)), INVALID)
    expect(status(s.Reserve, pb.ReserveRequest(namespace_id=ns, count=1, tier=tier)), INVALID)
    expect(status(s.Acquire, pb.AcquireRequest(namespace_id=ns, keys=keys, tier=tier)), INVALID)
    expect(status(s.Evict, pb.EvictRequest(tier=tier)), INVALID)
    lease = s.Reserve(pb.ReserveRequest(namespace_id=ns, count=1), timeout=10).lease
    expect(status(s.RenewLease, pb.RenewLeaseRequest(lease_id=lease.lease_id, ttl_s=ttl)),
           INVALID)
    s.Release(pb.ReleaseRequest(lease_id=lease.lease_id), timeout=10)


@FUZZ
@given(size=st.integers(min_value=0, max_value=2 * SMALL_BYTES).filter(
    lambda n: n != SMALL_BYTES), where=st.integers(min_value=0, max_value=3))
def test_wrong_payload_sizes(world, size, where):
    data = [bytes(SMALL_BYTES)] * 4
    data[where] = bytes(size)
    keys = chain(4, 1000 + where)
    expect(status(world.stub.Put, iter([pb.PutRequest(namespace_id=world.ns, blocks=[
        pb.Block(key=k, data=d) for k, d in zip(keys, data, strict=True)])])), INVALID)
    assert world.stub.Lookup(pb.LookupRequest(namespace_id=world.ns, keys=keys),
                             timeout=10).prefix_blocks == 0


@FUZZ
@given(model=st.text(max_size=30), dims=st.lists(st.integers(0, 1 << 20), min_size=4,
                                                 max_size=4),
       dtype=st.sampled_from(["", "float16", "bfloat16", "float32", "fp8", "int4", "x" * 50]),
       codec=st.sampled_from(["", "lossless", "int8", "zip"]),
       shard=st.tuples(st.integers(0, 10), st.integers(0, 10)),
       scheme=st.sampled_from(["", "kvstore-blake3-v1", "external", "external:vllm", "md5"]))
def test_register_namespace_specs(world, model, dims, dtype, codec, shard, scheme):
    layout = pb.KVLayout(num_layers=dims[0], num_kv_heads=dims[1], head_dim=dims[2],
                         block_tokens=dims[3], dtype=dtype)
    spec = pb.NamespaceSpec(model=model, layout=layout, codec=codec, shard_rank=shard[0],
                            shard_size=shard[1], hash_scheme=scheme)
    expect(status(world.stub.RegisterNamespace, pb.RegisterNamespaceRequest(spec=spec)),
           {OK, INVALID})
    expect(status(world.stub.RegisterNamespace, pb.RegisterNamespaceRequest()), INVALID)


def test_put_stream_rules(world):
    s, ns = world.stub, world.ns
    blk = [pb.Block(key=k, data=bytes(SMALL_BYTES)) for k in chain(2, 77)]
    other_ns = b"\x01" * 16
    expect(status(s.Put, iter([pb.PutRequest(namespace_id=ns, blocks=blk[:1]),
                               pb.PutRequest(namespace_id=other_ns, blocks=blk[1:])])),
           INVALID)
    expect(status(s.Put, iter([pb.PutRequest(namespace_id=ns, blocks=blk[:1]),
                               pb.PutRequest(parent=b"p" * 16, blocks=blk[1:])])), INVALID)
    expect(status(s.Put, iter([pb.PutRequest(namespace_id=ns, blocks=[blk[0], blk[0]])])),
           INVALID)
    expect(status(s.Put, iter([pb.PutRequest(blocks=blk)])), INVALID)
    expect(status(s.Delete, pb.DeleteRequest(namespace_id=ns)), INVALID)
    expect(status(s.Delete, pb.DeleteRequest(namespace_id=ns, keys=chain(1, 5), all=True)),
           INVALID)
    expect(status(s.Acquire, pb.AcquireRequest(namespace_id=ns)), INVALID)
    expect(status(s.Get, pb.GetRequest(namespace_id=ns)), INVALID)


@FUZZ
@given(method=st.sampled_from(sorted(METHODS)), raw=st.binary(max_size=300))
def test_random_bytes_as_messages(world, method, raw):
    kind = METHODS[method]
    path = f"/kvstore.v1.KVStore/{method}"
    call = getattr(world.channel, kind)(path, request_serializer=None,
                                         response_deserializer=None)
    request = iter([raw, raw]) if kind == "stream_unary" else raw
    expect(status(call, request), DOCUMENTED)


# ------------------------------------------------------------------------------ afterwards

def test_release_leases_past_the_cap_are_refused_and_repeats_count_once(world):
    """Carried releases end under the store lock, so one call may carry at most
    MAX_CARRIED_RELEASES of them: past that it is refused whole, before any ends."""
    s = world.stub
    held = s.Acquire(pb.AcquireRequest(namespace_id=world.ns, keys=world.keys[:1]),
                     timeout=10).lease.lease_id
    over = pb.AcquireRequest(namespace_id=world.ns, keys=world.keys[:1],
                             release_leases=[held] + ["a"] * MAX_CARRIED_RELEASES)
    with pytest.raises(grpc.RpcError) as err:
        s.Acquire(over, timeout=10)
    assert err.value.code() == INVALID and "limit is" in err.value.details()
    assert status(s.RenewLease, pb.RenewLeaseRequest(lease_id=held)) == OK   # none ended
    at_cap = pb.AcquireRequest(namespace_id=world.ns, keys=world.keys[:1],
                               release_leases=[held] * MAX_CARRIED_RELEASES)
    lease = s.Acquire(at_cap, timeout=10).lease.lease_id
    assert status(s.Release, pb.ReleaseRequest(lease_id=held)) == NOT_FOUND  # carried: ended
    s.Release(pb.ReleaseRequest(lease_id=lease), timeout=10)


def test_daemon_still_serves_and_stored_blocks_unchanged(world):
    assert world.d.alive()
    got, _ = get(world.stub, world.ns, world.keys)
    assert [k for k, _ in got] == world.keys
    assert [xxhash.xxh3_64_intdigest(d) for _, d in got] == world.sums
    look = world.stub.Lookup(pb.LookupRequest(namespace_id=world.ns, keys=world.keys),
                             timeout=10)
    assert look.prefix_blocks == N_STORED
    assert "Traceback" not in world.d.output()
