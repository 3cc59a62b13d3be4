"""The handlers of kvstore.v1.KVStore's RPCs, by what they do; kvstore/server.py runs each call.

| module | job |
| --- | --- |
| `namespaces` | RegisterNamespace, Lookup, Locate: answers from the index |
| `leases` | the slot path: Reserve, Commit, Acquire, Release, RenewLease, LookupReserve, |
| | LookupAcquire |
| `streams` | Put and Get: block bytes through gRPC messages |
| `admin` | Delete, Retain, Evict, Flush, Stats, within the caller's scope |
| `validate` | request parsing and the checks on every field a client controls |
| `replies` | leases and statistics as protobuf replies |
| `state` | what the groups share (`CallState`): store, auth, limits, block sizes |
"""
