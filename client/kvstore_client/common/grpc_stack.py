"""gRPC's socket layer for this process: the classic poller (iomgr) instead of EventEngine's
endpoints, unless GRPC_EXPERIMENTS is already set.

Why: with grpcio 1.85's default EventEngine endpoints every socket read completes on a pool
thread and hops to another before Python sees the message: ~25 context switches per 2 MiB
message on each side, and those threads used more CPU than all of the Python threads of the
Put/Get streams together (docs/performance.md). With the classic client and listener
(`-event_engine_client,-event_engine_listener`) the thread waiting on the completion queue
reads the socket itself; the receiving side of a stream ran 15-30% faster.

gRPC reads GRPC_EXPERIMENTS when it initialises (the first channel or server of the process),
so this runs when kvstore_client is first imported (the daemon imports it before grpc too). A
process that set GRPC_EXPERIMENTS (even to "") keeps its own choice; one that started gRPC
before importing kvstore_client keeps EventEngine.
"""

from __future__ import annotations

import os

EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def prefer_classic_poller() -> None:
    os.environ.setdefault("GRPC_EXPERIMENTS", EXPERIMENTS)
