"""What the daemon and the SDK share: the one part of `kvstore_client` the daemon imports.

Both sides of the wire agree on these; the daemon (`kvstore`, `tiers`) imports nothing else of the
SDK but the generated stubs (`kvstore_client._proto`), and nothing here imports the rest of the
SDK (tests/test_imports.py checks both). Importing this package loads nothing: each module is
imported by name.

| module | job |
| --- | --- |
| `errors` | the exceptions, one per status code (public path: `kvstore_client.errors`) |
| `layout` | `KVLayout`, `NamespaceSpec` (a namespace's identity and digest), codec names |
| `hashing` | the reference prefix hasher and the key-length limits (docs/hashing.md) |
| `address` | how an address names a daemon (Unix socket or host:port) |
| `handoff` | the client half of the Unix-socket handshake (daemon half: kvstore/handoff.py) |
| `lane_wire` | the fast lane's frame format (daemon: kvstore/lane.py, SDK: lane.py) |
| `shm`, `prefault` | attaching to and pre-faulting shared-memory segments |
| `pools` | device pools by description (CUDA IPC, CPU-device shm), mapped once per process |
| `cuda_runtime`, `pinning` | CUDA bindings (CuPy or libcudart) and host-memory pinning |
| `transfer`, `runs` | completion of an asynchronous copy; merging copy runs |
| `kernel_externs` | the C functions (memcpy, XXH3-64) compiled copy kernels call |
| `read_ahead` | a gRPC stream received on a thread of its own (Put in the daemon, Get in the SDK) |
| `lazy` | modules imported on first use (start-time budget) |
| `grpc_stack` | gRPC's socket layer for the process (the classic poller), set on first import |
"""
