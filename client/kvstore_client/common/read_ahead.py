"""A gRPC stream received on a thread of its own while the caller works on what already came.

Why: grpcio starts turning a stream's next message into a Python object (a copy of its bytes,
holding the GIL) only when the caller asks for it, and the caller then waits for that, with a
thread handoff each way. The SDK's Get copies each reply's blocks out with a compiled copy that
releases the GIL, and the daemon's Put stores each message's blocks; receiving the next message
meanwhile on another thread overlaps the two instead of taking turns. At most `depth` messages
wait here, so a consumer slower than the network holds a bounded number of them, and gRPC's
flow control holds the sender back as before.

The first `inline` messages are received on the caller's thread, and so is the next, whose
arrival starts the reader: a stream of at most `inline` messages (a Put of one message, with
inline=1) costs no thread.

Both ends use it (the daemon's Put, kvstore/handlers/streams.py; the SDK's Get,
kvstore_client/reads.py); it imports nothing but the standard library.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

_END = object()
_POLL_S = 0.05          # how often a reader blocked on a full queue looks for close()


class ReadAhead:
    """Iterate `stream` through a reader thread, at most `depth` items ahead.

    An error of the stream is raised where the consumer takes the item it stood for. `close()`
    (call it in a `finally`) stops the reader: it drops what was read ahead, calls `cancel`
    (where given) to end a reader blocked on the stream, and lets the thread end.
    """

    def __init__(self, stream: Any, depth: int = 2, cancel: Callable[[], Any] | None = None,
                 name: str = "kvstore-read-ahead", inline: int = 0) -> None:
        if depth < 1:
            raise ValueError("depth must be at least 1")
        self._stream = iter(stream)
        self._cancel = cancel
        self._depth = depth
        self._name = name
        self._inline = inline
        self._q: queue.Queue = queue.Queue(depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for msg in self._stream:
                if not self._put(msg):
                    return
            item: Any = _END
        except BaseException as e:  # noqa: BLE001 - handed to the consumer's thread
            item = e
        self._put(item)

    def __iter__(self) -> Iterator[Any]:
        for i in range(self._inline + 1):
            try:
                item = next(self._stream)
            except StopIteration:
                return
            if i == self._inline and not self._stop.is_set():    # the stream goes on
                self._thread = threading.Thread(target=self._run, name=self._name,
                                                daemon=True)
                self._thread.start()
            yield item
        while self._thread is not None:
            item = self._q.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive() and self._cancel is not None:
            self._cancel()
