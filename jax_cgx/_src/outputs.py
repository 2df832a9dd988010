"""A job's processes' output, as :mod:`jax_cgx.launch` reads it: copied to its own with each
line's rank (:func:`copy`), and read for what it reports on the way: the processes jax's
coordination service found unresponsive (:class:`HeartbeatWatch`), and when each process said it
failed (:class:`FailureWatch`; :func:`stamp` is the time jax_cgx.distributed puts in that line).
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["copy", "both", "HeartbeatWatch", "FailureWatch", "processes", "say_failed", "stamp"]


def processes(ranks: list[int]) -> str:
    """``process 1`` or ``processes 0, 2``: how the launcher's and the processes' lines name them."""
    return ("process " if len(ranks) == 1 else "processes ") + ", ".join(map(str, ranks))


def say_failed(rank: int, what: str) -> None:
    """``jax_cgx: process RANK WHAT [at T]`` on stderr: the failure line :class:`FailureWatch` reads."""
    print(f"jax_cgx: process {rank} {what} {stamp()}", file=sys.stderr)


def stamp() -> str:
    """The time a process fails, as its failure line carries it (``[at T]``, seconds since the
    epoch): the launcher names the process that failed first by it."""
    return f"[at {time.time():.6f}]"


# gloo's report of each connection (two per device and process at start). A healthy one (as many
# peers as expected) is not copied, nor the pieces of several that gloo's threads printed into one
# another; one that finds fewer peers than expected, printed whole, is.
_GLOO_REPORT = re.compile(r"^\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
                          r"Expected number of connected peer ranks is : (\d+)\s*$")
_GLOO_PIECES = re.compile(r"^(?:\[Gloo\] Rank | is connected to |peer ranks\.|Expected number of connected "
                          r"peer ranks is :|\d+|\s)+$")


def _gloo_noise(line: str) -> bool:
    report = _GLOO_REPORT.match(line)
    if report:
        return report.group(1) == report.group(2)
    return "connected" in line and bool(_GLOO_PIECES.match(line))


def copy(stream, prefix: str, out, watch: Callable[[str], None] | None = None) -> None:
    """Copy a process's output to ``out``, each line prefixed, until the process closes it; each
    line also goes to ``watch``. gloo's line for each healthy connection is left out.

    Bytes, decoded leniently: a byte that is not UTF-8 must not stop the copying (the process
    would block on a full pipe, and the job hang). If ``out`` goes away (``| head``), keep
    draining, for the same reason.
    """
    writing = True
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        if watch is not None:
            watch(line)
        if writing and not _gloo_noise(line):
            try:
                out.write(prefix + line)
                out.flush()
            except (OSError, ValueError):  # a closed or broken pipe: drain the rest unread
                writing = False
    stream.close()


# What jax's coordination service logs before it aborts the healthy processes: the marker, then
# the unhealthy tasks (jax.distributed process ids: the launcher's ranks), one line of ids.
_HEARTBEAT_MARKER = "stopped sending heartbeats"


class HeartbeatWatch:
    """The ranks jax's coordination service reported as no longer sending heartbeats, read off
    the processes' output as it goes by."""

    def __init__(self):
        self.unhealthy: set[int] = set()
        self._lock = threading.Lock()

    def watcher(self) -> Callable[[str], None]:  # one per process's output: each keeps its own place
        expecting = [False]

        def watch(line: str) -> None:
            if _HEARTBEAT_MARKER in line:
                expecting[0] = True
                tail = line.split(_HEARTBEAT_MARKER, 1)[1].lstrip("):").strip()
                if tail:
                    self._add(tail)
                return
            if expecting[0]:
                expecting[0] = self._add(line)

        return watch

    def _add(self, text: str) -> bool:
        """Record the task ids in ``text`` (``1`` or ``1, 3``); False if it holds none."""
        ids = text.replace(",", " ").split()
        if not ids or not all(t.isdigit() for t in ids):
            return False
        with self._lock:
            self.unhealthy.update(int(t) for t in ids)
        return True


# What jax_cgx.distributed prints the moment a process fails, stamped (stamp()) with the time it failed.
_FAILURE_LINE = re.compile(r"^jax_cgx: process (\d+) (?:failed|exits with status).*\[at (\d+(?:\.\d+)?)\]")


class FailureWatch:
    """When each process said it failed, read off its output as it goes by.

    A process whose uncaught exception (or non-zero ``sys.exit``) ends it prints ``jax_cgx: process
    N failed: [at T]`` at once, then runs its exit hooks (the tcp backend's teardown among them),
    which reset its peers' connections: a peer then fails too, and may well end first. The stamps,
    not the order the lines are read in (the copying threads race for the GIL), order the causes.
    """

    def __init__(self):
        self.said: dict[int, float] = {}
        self._lock = threading.Lock()

    def watcher(self, rank: int) -> Callable[[str], None]:
        def watch(line: str) -> None:
            m = _FAILURE_LINE.match(line)
            if m and int(m.group(1)) == rank:
                with self._lock:
                    self.said.setdefault(rank, float(m.group(2)))

        return watch

    def first(self) -> int | None:
        with self._lock:
            return min(self.said, key=self.said.get) if self.said else None


def both(*watchers: Callable[[str], None]) -> Callable[[str], None]:
    def watch(line: str) -> None:
        for w in watchers:
            w(line)

    return watch
