"""Batch sequence numbers that never go back, across daemon restarts and crashes.

Why: a consumer that sees a stream's sequence number go back (a publisher restarted from 0)
drops its batches as duplicates until the number passes the old one, keeping the blocks the
restart cleared. So a stream starts at the larger of the wall clock in microseconds and the
floor kept in its file, and keeps that floor RESERVE numbers ahead of what it has used: a
crash leaves a floor above every number sent, a clock stepped back is covered by the floor,
a lost file by the clock (a stream sends far fewer than a million batches a second).
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
        floor = 0
        try:
            floor = int(path.read_text().strip() or 0)
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:
            log.warning("events: ignoring sequence file %s (%s)", path, e)
        self.next = max(floor, time.time_ns() // 1000)
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
        """Keep the exact next number (a clean stop; the clock still decides at start)."""
        self._write(self.next)

    def _write(self, value: int) -> None:
        tmp = self.path.with_suffix(".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w") as f:
                f.write(f"{value}\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            self._failed = False
        except OSError as e:
            if not self._failed:
                log.warning("events: cannot write %s (%s); sequence numbers rest on the clock "
                            "alone until it can", self.path, e)
            self._failed = True
