"""KV events: which blocks this daemon holds, by tier, for cache-aware routers.

In vLLM's wire format (wire.py) on ZMQ streams the daemon serves (stream.py): a node stream of
its residency and, per local engine, that engine's own events merged with it (relay.py). The
index's residency seam tells a listener (recorder.py) of every change under the store lock; a
thread (publisher.py) turns them into events off the lock. Blocks are announced with the
token ids routers index by (texts.py), found for each block where they are kept or learned
(pending.py); sequence numbers never go back (seqfile.py). The store builds it all
(service.py) when [events] is on; nothing here imports pyzmq otherwise.
docs/routing.md describes the streams and their deployment.
"""
