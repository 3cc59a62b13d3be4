"""What Linux's /proc says a process used: CPU seconds, and its threads' waits for a core.

The benches that share one machine with the daemon they measure read these to tell the
daemon's own cost from the machine's (a 2-core machine runs the clients, the daemon and
anything else at once). Linux only; where /proc does not answer, the figures read 0.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds used so far by process `pid`, or by this process (every
    thread, ended ones included) where pid is None; clock-tick resolution."""
    if pid is None:
        import resource
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_runq_s() -> float:
    """Seconds the calling thread has waited for a CPU while runnable (schedstat)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class RunQueue:
    """Seconds the threads of a process waited for a CPU while runnable (schedstat) over a
    window: how much the machine's cores, not the process, held them back.

    Read per thread, sampled: a process's total is not in /proc (its own schedstat is its
    first thread's), and a thread that ends takes its figure with it. Summing the threads
    alive at the start and at the end would subtract the whole past wait of every thread that
    ended in the window and miss the wait of threads that came and went in it. Here each
    thread counts from its first sample to its last, so sample as often as threads come and
    go (a window of long-lived threads needs a sample at each end only)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.first: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.sample()

    def sample(self) -> None:
        try:
            tasks = list(Path(f"/proc/{self.pid}/task").iterdir())
        except OSError:
            return
        for task in tasks:
            try:
                wait = int((task / "schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue
            self.first.setdefault(task.name, wait)
            self.last[task.name] = wait

    def seconds(self) -> float:
        return sum(v - self.first[t] for t, v in self.last.items()) / 1e9
