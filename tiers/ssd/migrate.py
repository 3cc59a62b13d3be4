"""Moving an SSD tier folder of the old format (payloads inside LMDB) into the current one.

Why it still exists: a daemon upgraded in place must not lose the blocks its folder holds, and
must not misread them either. The old format kept payloads as LMDB values in a `blocks`
database of an environment at the top of the folder (`data.mdb`); the current one keeps them
in the payload file with an index beside it (tiers/ssd/__init__.py). The copy goes through the
ordinary write path, so a crash midway leaves the old files in place and the next open starts
again; only after every block is written and synced are the old files removed.

Each old value is checked against its frame's payload hash before it is copied: in the old
format that hash was a value's only guard, and once copied the value gets a record checksum of
its own, which reads trust instead of the frame's hash. A value that fails is left behind (a
miss), never carried over under a checksum that vouches for it.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Callable

import lmdb
from kvstore_client.common.errors import DataLoss, Unavailable

from .. import frame
from .index import LmdbIndex

log = logging.getLogger("kvstore.ssd")

LEGACY_FILE = "data.mdb"
_BATCH = 64
_SIZE = struct.Struct("<Q")         # the old meta record's leading value size


def is_legacy(folder: str) -> bool:
    return os.path.exists(os.path.join(folder, LEGACY_FILE))


def migrate_legacy(folder: str, index: LmdbIndex,
                   put_many: Callable[[list[tuple[bytes, bytes, bytes]]], None],
                   sync: Callable[[], None]) -> None:
    """Copy the old folder's namespaces, state and blocks into the current format through
    `index` and `put_many`, `sync`, then remove the old files; Unavailable (one line) when
    the old folder cannot be read."""
    try:
        old = lmdb.open(folder, subdir=True, readonly=True, lock=False, max_dbs=8)
    except lmdb.Error as exc:
        raise Unavailable(f"the SSD tier at {folder} is in the old format and cannot be "
                          f"read for migration ({exc}); move the folder away") from exc
    moved = corrupt = 0
    try:
        dbs = {n: old.open_db(n, create=False) for n in (b"blocks", b"meta", b"namespaces",
                                                        b"state")}
        with old.begin() as txn:
            for k, v in txn.cursor(db=dbs[b"namespaces"]):
                index.put_namespace(k, v)
            for k, v in txn.cursor(db=dbs[b"state"]):
                index.put_state(k, v)
            batch: list[tuple[bytes, bytes, bytes]] = []
            for k, raw in txn.cursor(db=dbs[b"meta"]):
                value = txn.get(k, db=dbs[b"blocks"])
                if value is None:
                    continue
                try:
                    frame.unframe(value)
                except DataLoss as exc:
                    log.warning("not migrating block %s of the SSD tier at %s: %s",
                                k.hex(), folder, exc)
                    corrupt += 1
                    continue
                batch.append((k, value, raw[_SIZE.size:]))
                if len(batch) == _BATCH:
                    put_many(batch)
                    moved += len(batch)
                    batch = []
            put_many(batch)
            moved += len(batch)
    except (lmdb.Error, KeyError) as exc:
        raise Unavailable(f"the SSD tier at {folder} is in the old format and its "
                          f"migration failed ({exc}); move the folder away") from exc
    finally:
        old.close()
    sync()
    for name in (LEGACY_FILE, "lock.mdb"):
        try:
            os.unlink(os.path.join(folder, name))
        except FileNotFoundError:
            pass
    log.warning("migrated %d blocks of the SSD tier at %s to the payload-file format (%d "
                "corrupt ones left behind)", moved, folder, corrupt)
