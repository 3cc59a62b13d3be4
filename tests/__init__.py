"""The test suite. kvstore_client is imported first, before anything starts gRPC, so tests run
on the socket layer the SDK and the daemon choose (kvstore_client/common/grpc_stack.py)."""

import kvstore_client  # noqa: F401
