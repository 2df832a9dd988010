"""The launcher's children's ends, noted in the order they happen.

:func:`watch` notes each process's end, ``(rank, returncode)``, as it happens. Where the kernel
has pidfds (Linux 5.3+) one thread polls them all: a poll returns the processes that had ended
when it returned, so a crash is noted before the peer that exits because of it a few ms later.
A thread per process, the fallback elsewhere, wakes in that order too but notes its end only once
it holds the GIL, which does not go first to the first to wake: with one, CI saw a rank that
exited 3 after its peer's SIGSEGV named as the first failure, about 1 run in 10 here.
"""

from __future__ import annotations

import os
import select
import subprocess
import threading
from collections.abc import Callable

__all__ = ["watch"]


def watch(procs: list[subprocess.Popen], noted: Callable[[int, int], None]) -> None:
    """Call ``noted(rank, returncode)`` for each of ``procs`` (rank = its index) as it ends, from
    daemon threads, in the order they end."""
    waiting = dict(enumerate(procs))
    groups = [waiting] if hasattr(os, "pidfd_open") else [{rank: proc} for rank, proc in waiting.items()]
    for group in groups:
        threading.Thread(target=_note_ends, args=(group, noted), daemon=True).start()


def _note_ends(waiting: dict[int, subprocess.Popen], noted: Callable[[int, int], None]) -> None:
    if len(waiting) == 1 or not hasattr(os, "pidfd_open"):
        for rank, proc in waiting.items():
            noted(rank, proc.wait())
        return
    # A process that ended already is still there (not reaped): its pidfd is ready at once.
    ranks = {os.pidfd_open(proc.pid): rank for rank, proc in waiting.items()}
    poller = select.poll()
    for fd in ranks:
        poller.register(fd, select.POLLIN)
    while ranks:
        ended = []
        for fd, _ in poller.poll():
            poller.unregister(fd)
            os.close(fd)
            rank = ranks.pop(fd)
            ended.append((rank, waiting[rank].wait()))
        # Ended together (this thread woke late: under load, or the GIL held by the output threads
        # printing a traceback): one killed by a signal first, as a crash or a kill is the cause a
        # peer exits over and not the other way round; then the lower rank.
        for rank, status in sorted(ended, key=lambda e: (e[1] >= 0, e[0])):
            noted(rank, status)
