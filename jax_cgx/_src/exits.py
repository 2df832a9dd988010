"""Ending a failed process at once, without jax's shutdown barrier (jax_cgx.distributed's exit hooks).

jax registers (at import) an exit hook whose ``jax.distributed.shutdown()`` waits for every
other process. A process that fails must not wait there: its peers may be computing for
hours or blocked in a collective with it, and the launcher only learns of the failure
when the process is gone. Uncaught exceptions go through ``sys.excepthook``; a
``SystemExit`` does not, and Python keeps its status to itself until after every exit
hook has run. So ``sys.exit``, ``exit`` and ``quit`` raise a ``SystemExit`` subclass that
notes its status when it is released with no Python frame left on the main thread: that
is, when the interpreter consumed it at the top level (a caught one is released inside
the frame that caught it). An exit hook registered after jax's (so it runs before it) then
marks the process failed. The program's own exit hooks (loggers, checkpoint writers) still run:
hooks run last-registered first, and the one that ends the process is registered when jax_cgx
is imported, right after jax's, so every hook the program registers later runs before it.
"""

from __future__ import annotations

import atexit
import builtins
import dis
import functools
import gc
import logging
import os
import sys
import threading
import traceback

import jax  # first: its exit hook must be registered before this module's

from jax_cgx._src import outputs

__all__ = ["NO_BARRIER", "exit_now", "failing", "install"]

NO_BARRIER = "without waiting for the other processes in jax's shutdown barrier"
_hooks_installed = False
_exit_status: int | None = None  # the status of a recorded SystemExit that reached the top level
_failed_with: int | None = None  # set when the process fails: its status, once the exit hooks have run
_undecided = None  # install()'s check, at exit, of how the program ended (run once, by _decide)


def _fail_at_exit(status: int) -> None:
    """End with ``status`` once the program's exit hooks have run (instead of in jax's barrier)."""
    global _failed_with
    if _failed_with is None:
        _failed_with = status


def failing() -> bool:
    """At exit: whether this process is exiting with a failure. How the program ended (an uncaught
    ``SystemExit``'s status) is known only once it is over, so an exit hook that asks decides it."""
    _decide()
    return _failed_with is not None


def _decide() -> None:
    global _undecided
    check, _undecided = _undecided, None
    if check is not None:
        check()


def _end_failed_process() -> None:
    if _failed_with is not None:
        exit_now(_failed_with)


atexit.register(_end_failed_process)  # at import: after jax's hooks, before any the program registers


def _status(code: object) -> int:
    """The process status Python gives ``SystemExit(code)``: None is 0, an int is itself, else 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF  # what exit(3) reports to the parent (sys.exit(256) exits 0)
    return 1  # Python has printed the message to stderr


class _SystemExit(SystemExit):
    """A ``SystemExit`` that records its status if the interpreter consumes it uncaught."""

    def __del__(self, _getframe=sys._getframe, _get_ident=threading.get_ident):
        try:
            if _get_ident() != _main_thread_ident:
                return  # SystemExit in another thread only ends that thread
            try:
                _getframe(1)
            except ValueError:  # no caller: released by the interpreter, not by an except clause
                global _exit_status
                _exit_status = _status(self.code)
        except Exception:  # noqa: BLE001 - a finalizer must not raise; late in shutdown globals may be gone
            pass

    def __reduce__(self):
        return SystemExit, self.args


_SystemExit.__name__ = _SystemExit.__qualname__ = "SystemExit"  # tracebacks and reprs as usual
_SystemExit.__module__ = "builtins"
_main_thread_ident = threading.main_thread().ident


def _sys_exit(*status):
    if len(status) > 1:
        raise TypeError(f"exit expected at most 1 argument, got {len(status)}")
    raise _SystemExit(*status)


class _Quitter:
    """``exit`` / ``quit`` (site.Quitter), raising a recorded SystemExit."""

    def __init__(self, original):
        self._original = original

    def __repr__(self) -> str:
        return repr(self._original)

    def __call__(self, code=None):
        try:
            self._original(code)
        except SystemExit as e:
            raise _SystemExit(e.code) from None


def _ended_by(frame) -> str | None:
    """How a finished outermost frame ended: "return", "exception", or None if unknown."""
    try:
        opname = dis.opname[frame.f_code.co_code[frame.f_lasti]]
    except Exception:  # noqa: BLE001 - only a cross-check
        return None
    return "return" if opname.startswith("RETURN") else "exception"


def exit_now(status: int) -> None:
    for flush in (logging.shutdown, sys.stdout.flush, sys.stderr.flush):
        try:
            flush()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    os._exit(status)


def _held_system_exit(outermost) -> SystemExit | None:
    """The SystemExit the interpreter is exiting with, if something still holds it: one raised
    by a ``sys.exit`` looked up before the hooks were installed (absl's ``app.run`` evaluates
    ``sys.exit`` in ``sys.exit(main(argv))`` before ``main`` runs) and kept alive in a reference
    cycle (``app.run`` keeps ``exc = sys.exc_info()[1]`` in a frame its traceback holds).
    Searched only on this rare path: it walks every object.

    An exception's traceback starts at the frame that last caught it (Python 3.11 does not
    extend it while an uncaught exception unwinds). One caught in the outermost frame at
    another instruction than the one that frame ended on is an earlier exit the script caught
    and kept, not the one it ends with; one whose frames do not lead to the outermost frame
    is not the script's either. If more than one candidate is left, the status is unknown."""
    def may_have_ended_the_script(e: SystemExit) -> bool:
        tb = e.__traceback__
        if tb is None:
            return False
        if tb.tb_frame is outermost:
            return tb.tb_lasti == outermost.f_lasti
        frame = tb.tb_frame
        while frame is not None and frame is not outermost:
            frame = frame.f_back
        return frame is outermost

    held = [obj for obj in gc.get_objects() if isinstance(obj, SystemExit) and may_have_ended_the_script(obj)]
    return held[0] if len(held) == 1 else None


def install(rank: int) -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    _exit_on_uncaught_exception(rank)
    sys.exit = functools.wraps(sys.exit)(_sys_exit)
    for name in ("exit", "quit"):
        if hasattr(builtins, name):  # absent under python -S
            setattr(builtins, name, _Quitter(getattr(builtins, name)))
    outermost = None
    if threading.get_ident() == _main_thread_ident:
        outermost = sys._getframe()
        while outermost.f_back is not None:
            outermost = outermost.f_back

    def on_exit():
        if not jax.distributed.is_initialized():
            return  # no barrier ahead (the script shut jax down itself): exit as Python does
        ended = _ended_by(outermost) if outermost is not None else None
        if ended == "return":
            return  # the script ran to its end: status 0, jax's normal shutdown
        if _failed_with is not None:
            return  # our excepthook saw it fail
        uncaught = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        if uncaught is not None and not isinstance(uncaught, SystemExit):
            # Another sys.excepthook (rich.traceback.install(), ...) replaced ours and printed it.
            outputs.say_failed(rank, f"failed ({type(uncaught).__name__}); exiting with status 1, {NO_BARRIER}")
            _fail_at_exit(1)
            return
        status = _exit_status
        if status is None and ended == "exception":
            held = _held_system_exit(outermost)
            status = None if held is None else _status(held.code)
        if status:
            outputs.say_failed(rank, f"exits with status {status}, {NO_BARRIER}")
            _fail_at_exit(status)
        elif status is None and ended == "exception":
            print(f"jax_cgx: process {rank} is exiting through an exception whose status jax_cgx "
                  "cannot see (a `raise SystemExit(...)` statement, or a sys.exit imported before "
                  "jax_cgx.distributed.initialize()); jax's shutdown barrier now waits for the other "
                  "processes. Exit with sys.exit(status) to end at once.", file=sys.stderr)
            sys.stderr.flush()

    global _undecided
    _undecided = on_exit
    atexit.register(_decide)  # after jax's own (registered when jax was imported): runs before it


def _exit_on_uncaught_exception(rank: int) -> None:
    previous = sys.excepthook

    def hook(kind, value, tb):
        if issubclass(kind, KeyboardInterrupt):
            previous(kind, value, tb)
            _fail_at_exit(128 + 2)  # as Python reports Ctrl-C: the status of SIGINT
            return
        outputs.say_failed(rank, "failed:")
        traceback.print_exception(kind, value, tb)
        # Skip jax's blocking shutdown barrier, once the program's exit hooks ran: the launcher
        # sees the failure as soon as this process is gone, not when its peers finish.
        _fail_at_exit(1)

    sys.excepthook = hook
