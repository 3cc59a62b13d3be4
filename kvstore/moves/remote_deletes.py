"""Remote deletes Redis did not answer: kept, read as absent, sent again, and kept across restarts.

Why: a Delete while Redis was down answered "deleted", and once Redis was back (a restart from
its snapshot, a failover) Lookup found the blocks again and Get served them. So the keys of a
delete that did not reach Redis wait here: an existence check reads them as absent
(HostRemote.not_deleted), and they are sent again with each later delete and each write that
lands, and every RETRY_S by a thread of their own while any wait (a daemon with no traffic
would otherwise hold them for good). At most MAX_KEYS wait; past that the oldest are given up,
counted (`remote_deletes_given_up`).

Why a file: a restart used to forget them, and the blocks came back with the next start. The
waiting keys are written to `<data_dir>/remote-deletes` whenever they changed (by the retry
thread, so at most RETRY_S late) and at a stop, and read back at the next start. A crash loses
at most the last RETRY_S of changes. The file is written whole and renamed into place, so a
crash mid-write leaves the previous one; a damaged one is logged and removed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import msgpack

from ..state import StoreState

log = logging.getLogger("kvstore.store")

MAX_KEYS = 65536            # deletes kept to send again
RETRY_S = 1.0               # how often waiting deletes are sent again, and the file updated
FILE_NAME = "remote-deletes"
MAX_KEY_BYTES = 1024        # a global key read back longer than this marks the file damaged


class PendingDeletes:
    """The keys whose remote delete has not reached Redis, oldest first (module docstring).
    `resend()` sends them again (HostRemote.delete with no new keys; called locked)."""

    def __init__(self, state: StoreState, resend: Callable[[], None]) -> None:
        self.state = state
        self._resend = resend
        self._path = Path(state.config.data_dir) / FILE_NAME
        self._keys: dict[bytes, None] = {}
        self._saved = True          # the file holds what _keys holds
        self._started = False       # start(): the daemon's background work runs
        self._retrying = False
        self._load()

    # -- what the movers ask (locked) ------------------------------------------------------------
    def __bool__(self) -> bool:
        return bool(self._keys)

    def __contains__(self, gkey: bytes) -> bool:
        return gkey in self._keys

    def keys(self) -> list[bytes]:
        return list(self._keys)

    def take(self, gkeys: list[bytes]) -> list[bytes]:
        """Remove the keys a write is about to replace; the ones that were waiting (to be put
        back with `settle([], them)` if the write does not land)."""
        out = [g for g in gkeys if g in self._keys]
        for g in out:
            del self._keys[g]
        if out:
            self._changed()
        return out

    def settle(self, sent: Iterable[bytes], failed: Iterable[bytes]) -> None:
        """What a delete round trip left to send again: `sent` reached Redis unless in
        `failed`."""
        keys = self._keys
        before = set(keys)
        for g in sent:
            keys.pop(g, None)
        for g in failed:
            keys[g] = None
        while len(keys) > MAX_KEYS:
            keys.pop(next(iter(keys)))
            self.state.counters["remote_deletes_given_up"] += 1
        if keys.keys() != before:       # (Redis still down: the same keys, no new file)
            self._changed()

    def _changed(self) -> None:
        self._saved = False
        self.state.counters["remote_deletes_waiting"] = len(self._keys)
        self._start_retries()

    # -- the retry thread ------------------------------------------------------------------------
    def start(self) -> None:
        """(locked) Let the retry thread run from now on, now if deletes wait."""
        self._started = True
        if self._keys or not self._saved:
            self._start_retries()

    def _start_retries(self) -> None:
        if self._started and not self._retrying:
            self._retrying = True
            threading.Thread(target=self._retry, name="kvstore-remote-deletes",
                             daemon=True).start()

    def _retry(self) -> None:
        """Every RETRY_S: send the waiting deletes again and write the file if they changed,
        until none waits and the file says so, or the store closes."""
        st = self.state
        while True:
            time.sleep(RETRY_S)
            with st.lock:
                try:
                    if st.closed:
                        return
                    if self._keys:
                        self._resend()
                    if not self._saved:
                        blob = self._blob()
                        self._saved = True
                        with st.unlocked():
                            self._write(blob)
                    if not self._keys and self._saved:
                        return
                except Exception:  # noqa: BLE001 - a failed round trip or write: next round
                    self._saved = False
                    log.exception("sending waiting remote deletes again failed")
                finally:
                    if st.closed or (not self._keys and self._saved):
                        self._retrying = False

    # -- the file --------------------------------------------------------------------------------
    def save(self) -> None:
        """(at a stop, locked) Write the file now if it is behind."""
        if not self._saved:
            try:
                self._write(self._blob())
                self._saved = True
            except OSError as exc:
                log.warning("%d remote deletes that did not reach Redis could not be kept "
                            "for the next start (%s): their blocks may be found there again",
                            len(self._keys), exc)

    def _blob(self) -> bytes | None:
        return msgpack.packb(list(self._keys)) if self._keys else None

    def _write(self, blob: bytes | None) -> None:
        path = self._path
        if blob is None:
            path.unlink(missing_ok=True)
            return
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def _load(self) -> None:
        path = self._path
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("cannot read %s (%s): remote deletes a previous run could not send "
                        "are not retried", path, exc)
            return
        try:
            keys = msgpack.unpackb(blob)
            if not isinstance(keys, list) or not all(
                    isinstance(k, bytes) and 0 < len(k) <= MAX_KEY_BYTES for k in keys):
                raise ValueError("not a list of keys")
        except Exception as exc:  # noqa: BLE001 - damaged: logged, removed
            log.warning("%s is damaged (%s); removed: remote deletes a previous run could not "
                        "send are not retried", path, exc)
            path.unlink(missing_ok=True)
            return
        self._keys = dict.fromkeys(keys[-MAX_KEYS:])
        self.state.counters["remote_deletes_waiting"] = len(self._keys)
        if self._keys:
            log.info("%d remote deletes a previous run could not send wait to be sent again",
                     len(self._keys))
