"""A process left waiting in a collective its peers never run, ended in seconds with its name.

When one process of a job runs one collective more than the others (a step too many, an
evaluation only it reaches), it waits in that collective for peers that have finished their
program and wait, in turn, in jax's shutdown barrier: nothing moves until the barrier times out
(``shutdown_timeout_seconds``, 300 s by default), then jax aborts every process without a Python
exception. Neither side can tell from inside jax that the other has given up.

So each process that :func:`jax_cgx.distributed.initialize` started says, in jax's coordination
service, when its program has ended (:func:`watch`'s exit hook, before jax's barrier), and a
thread in each process reads those marks. A process whose main thread has sat in one jax call
(the same Python frame, at the same instruction) for ``timeout_s`` after a peer finished is the
one in the unmatched collective: it prints a failure line naming itself, the call and the peers
that finished, marks itself ended, and exits with status 1 without jax's barrier. The finished
peers, waiting in their exit hook, see that mark and leave too (status 0: their program ran to
its end); so they do when a process fails (an uncaught exception, a non-zero ``sys.exit``:
it marks itself ended on its way out), instead of waiting for jax's heartbeat timeout (100 s)
to abort them. A process that works on alone after its peers finished (an evaluation on its own data,
a file it writes, a sleep) is left alone unless one jax call blocks for ``timeout_s``; raise
``JAX_CGX_UNMATCHED_TIMEOUT_S`` for such a job, or set it to 0 to turn the watch off.

The finished processes wait for the others in their exit hook at most jax's shutdown timeout;
past it they exit with status 1 and name the processes that never finished, instead of jax's
SIGABRT.
"""

from __future__ import annotations

import atexit
import numbers
import os
import sys
import threading
import time
import traceback

import jax
import jaxlib

from jax_cgx._src import exits, outputs
from jax_cgx._src.arguments import timeout_seconds

__all__ = ["DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "timeout_from_env", "watch"]

TIMEOUT_ENV = "JAX_CGX_UNMATCHED_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 20.0
_PREFIX = "jax_cgx/unmatched"
_POLL_S = 1.0  # how often the watch reads the finished marks (one small RPC to the coordinator)
_EXIT_POLL_S = 0.1  # how often a finished process's exit hook reads them
_LEAVE_S = 2.0  # how long an ended process waits for its finished peers to read its mark
# Frames in these packages are "inside a jax call": where a main thread blocked in a
# collective sits (reading an array's value, dispatching a jitted step).
_JAX_PACKAGES = tuple(os.path.dirname(module.__file__) + os.sep for module in (jax, jaxlib)) + (
    os.path.dirname(os.path.dirname(__file__)) + os.sep,)


def timeout_from_env(timeout_s: float | None, api: str) -> float:
    """``timeout_s``, else ``$JAX_CGX_UNMATCHED_TIMEOUT_S``, else 20 s; 0 turns the watch off."""
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real)):
        raise ValueError(f"{api}: unmatched_timeout_s must be a finite number of seconds >= 0 (0 turns the watch "
                         f"off), got {timeout_s!r}")
    return timeout_seconds(timeout_s, TIMEOUT_ENV, api, default=DEFAULT_TIMEOUT_S, name="unmatched_timeout_s",
                           zero_is_off=True)


def watch(state, rank: int, count: int, timeout_s: float, shutdown_timeout_s: float) -> None:
    """Start the watch for this process (``rank`` of ``count``) on jax's distributed ``state``
    (``timeout_s`` 0: only the finished mark and the bounded wait before jax's barrier).

    The process counts as finished where jax would shut down: at exit (an exit hook, which runs
    before jax's, registered when jax was imported), or where the program calls
    ``jax.distributed.shutdown()`` itself. A process exiting with a failure marks itself ended,
    not finished: the finished peers then leave at once, the others learn of it from their broken
    collectives.
    """
    client = state.client
    stop = threading.Event()
    thread = None
    if timeout_s > 0:
        thread = threading.Thread(target=_watch, name="jax_cgx-unmatched-watch", daemon=True,
                                  args=(client, rank, timeout_s, threading.main_thread(), stop))
        thread.start()

    def finish(at_exit: bool) -> None:
        if stop.is_set():
            return  # finished once already
        stop.set()
        if thread is not None:
            thread.join()
        if at_exit and exits.failing():
            _mark(client, rank, "ended", "failed")  # the finished peers need not wait for it
        else:
            _finish(client, rank, count, shutdown_timeout_s)

    jax_shutdown = state.shutdown

    def shutdown() -> None:
        del state.shutdown  # jax's own again, for a later initialize
        finish(at_exit=False)
        jax_shutdown()

    state.shutdown = shutdown  # jax.distributed.shutdown() and jax's exit hook both call it
    atexit.register(finish, at_exit=True)


def _mark(client, rank: int, kind: str, text: str) -> None:
    try:
        client.key_value_set(f"{_PREFIX}/{kind}/{rank}", text)
    except Exception:  # noqa: BLE001 - the coordination service is gone: nobody to tell
        pass


def _marks(client, kind: str) -> dict[int, str]:
    """The ranks that left a ``kind`` mark ("finished", "ended", "left"), with its text."""
    return {int(key.rsplit("/", 1)[1]): value for key, value in client.key_value_dir_get(f"{_PREFIX}/{kind}/")}


def _watch(client, rank: int, timeout_s: float, main: threading.Thread, stop: threading.Event) -> None:
    held = lasti = None  # the main thread's innermost frame, and where in it, when last seen moving
    since = first_finished = None
    while not stop.wait(_POLL_S):
        try:
            finished = _marks(client, "finished")
        except Exception:  # noqa: BLE001 - the service is gone (shut down, or its host ended): nothing to watch
            return
        frame = sys._current_frames().get(main.ident)
        if frame is None:
            return
        now = time.monotonic()
        if frame is not held or frame.f_lasti != lasti:
            held, lasti, since = frame, frame.f_lasti, now
        if finished and first_finished is None:
            first_finished = now
        # Blocked in one jax call for timeout_s, all of it after a peer finished.
        if first_finished is not None and now - max(since, first_finished) >= timeout_s \
                and _in_jax_call(frame, main.native_id):
            _end(client, rank, sorted(finished), now - since, frame)
            return


def _in_jax(frame) -> bool:
    return frame.f_code.co_filename.startswith(_JAX_PACKAGES)


def _in_jax_call(frame, native_id: int | None) -> bool:
    """Whether the main thread, stopped at ``frame``, waits in jax: in jax's own Python code
    (reading an array), or in a call the program made (a jitted step: jax's dispatch waits, on a
    futex, for the threads that run the computation). Not in a sleep, a file or socket read, or a
    child process (the kernel's wait channel tells; where /proc has none, only jax's code counts)."""
    if _in_jax(frame):
        return True
    try:
        with open(f"/proc/self/task/{native_id}/wchan") as f:
            return f.read().startswith("futex")
    except OSError:
        return False


def _call_site(frame) -> str:
    """The program's own line the jax call was made from: the innermost frame outside jax."""
    while frame is not None and _in_jax(frame):
        frame = frame.f_back
    if frame is None:
        return "(inside jax)"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def _end(client, rank: int, finished: list[int], waited: float, frame) -> None:
    outputs.say_failed(
        rank,
        f"failed: it has waited {waited:.0f} s in a jax call ({_call_site(frame)}) since {outputs.processes(finished)} "
        "finished the program: a collective no other process will join (the processes ran different numbers "
        f"of steps or collectives); exiting with status 1 instead of waiting for jax's shutdown barrier. A "
        f"process that rightly computes alone at the end for longer: raise {TIMEOUT_ENV} (0 turns this off)",
    )
    print(f"jax_cgx: process {rank} was waiting here:\n" + "".join(traceback.format_stack(frame)).rstrip(),
          file=sys.stderr)
    _mark(client, rank, "ended", "ended in a collective no other process joined")
    try:
        deadline = time.monotonic() + _LEAVE_S
        while time.monotonic() < deadline and not set(finished) <= set(_marks(client, "left")):
            time.sleep(_EXIT_POLL_S)
    except Exception:  # noqa: BLE001 - the peers learn of the end from the broken connections instead
        pass
    exits.exit_now(1)


def _finish(client, rank: int, count: int, shutdown_timeout_s: float) -> None:
    """Mark this process finished; wait until every process has, or one ended in an unmatched collective."""
    try:
        client.key_value_set(f"{_PREFIX}/finished/{rank}", f"{time.time():.3f}")
        deadline = time.monotonic() + shutdown_timeout_s
        while True:
            ended = _marks(client, "ended")
            if ended:
                _mark(client, rank, "left", "")
                why = "; ".join(f"process {r} {reason}" for r, reason in sorted(ended.items()))
                print(f"jax_cgx: process {rank} finished the program; {why} (see its output); leaving without "
                      "jax's shutdown barrier", file=sys.stderr)
                if rank == 0:
                    time.sleep(_LEAVE_S)  # it serves the coordination service: leave last
                exits.exit_now(0)
            finished = _marks(client, "finished")
            if len(finished) >= count:
                return  # all here: jax's barrier passes at once
            if time.monotonic() > deadline:
                missing = sorted(set(range(count)) - set(finished))
                outputs.say_failed(rank, f"failed: it finished the program, but {outputs.processes(missing)} had not "
                                   f"{shutdown_timeout_s:g} s later (shutdown_timeout_seconds); exiting with "
                                   "status 1 instead of jax's abort")
                exits.exit_now(1)
            time.sleep(_EXIT_POLL_S)
    except Exception:  # noqa: BLE001 - the coordination service is gone: jax's shutdown reports it
        return
