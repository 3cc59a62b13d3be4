"""Batch sequence numbers that never go back, across daemon restarts and crashes.

Why: a consumer that sees a stream's sequence number go back (a publisher restarted from 0)
drops its batches as duplicates until the number passes the old one, keeping the blocks the
restart cleared. So while a stream runs, its file keeps a floor RESERVE numbers ahead of what
it has used, and a clean stop writes the exact next number ("<n> clean"). A start after a clean
stop goes on from there (consumers see no gap, so they ask for no replay); any other start
takes the larger of the floor and the wall clock in microseconds: a crash leaves a floor above
every number sent, a lost file is covered by the clock (a stream sends far fewer than a million
batches a second), a clock stepped back by the floor.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger("kvstore.events")

RESERVE = 1 << 20


class SeqFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        floor, clean = 0, False
        try:
            words = path.read_text().split()
            floor, clean = int(words[0]), words[1:] == ["clean"]
        except FileNotFoundError:
            pass
        except (OSError, ValueError, IndexError) as e:
            log.warning("events: ignoring sequence file %s (%s)", path, e)
        self.next = floor if clean else max(floor, time.time_ns() // 1000)
        self._floor = 0
        self._failed = False
        self._reserve()

    def take(self) -> int:
        seq = self.next
        self.next += 1
        if self.next >= self._floor:
            self._reserve()
        return seq

    def _reserve(self) -> None:
        self._floor = self.next + RESERVE
        self._write(self._floor)

    def close(self) -> None:
        """Keep the exact next number: the next start goes on from it."""
        self._write(self.next, " clean")

    def _write(self, value: int, note: str = "") -> None:
        tmp = self.path.with_suffix(".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w") as f:
                f.write(f"{value}{note}\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            self._failed = False
        except OSError as e:
            if not self._failed:
                log.warning("events: cannot write %s (%s); sequence numbers rest on the clock "
                            "alone until it can", self.path, e)
            self._failed = True
