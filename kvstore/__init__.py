"""kvstore daemon: block index, leases, eviction, tier movement, gRPC server."""
