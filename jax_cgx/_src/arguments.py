"""Argument checks shared across jax_cgx.

- argparse types of the command lines (``jax_cgx.bench``, ``jax_cgx.launch``): a value out of
  range is an argparse error that names the flag, before anything runs;
- :func:`check_bool`, the check of every boolean argument of a public function
  (``return_residual``, ``tiled``, ``error_feedback``, ...): only a real bool is accepted;
- :func:`check_axes`, the axes a data-parallel mean or a sharded optimizer runs over;
- :func:`timeout_seconds`, every waiting timeout (nccl and tcp set-up, the cross-process agreement):
  an argument, else its environment variable, else 300 s.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Hashable

import numpy as np

from jax_cgx._src import compat


def integer(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number >= ``minimum``.

    Args:
      minimum: the least value accepted.

    Returns:
      ``parse(text) -> int``, which raises ``argparse.ArgumentTypeError`` (an argparse error naming
      the flag) for text that is not a whole number or is below ``minimum``.
    """
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def number(minimum: float, *, above: bool = False) -> Callable[[str], float]:
    """A finite float >= ``minimum`` (> with ``above``).

    An argparse ``type``.

    Args:
      minimum: the least value accepted.
      above: refuse ``minimum`` itself too.

    Returns:
      ``parse(text) -> float``, which raises ``argparse.ArgumentTypeError`` (an argparse error naming
      the flag) for text that is not a finite number in range.
    """
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < minimum or (above and value == minimum):
            raise argparse.ArgumentTypeError(f"must be a finite number {'>' if above else '>='} {minimum:g}, "
                                             f"got {text}")
        return value

    return parse


# --- arguments of public functions --------------------------------------------------------


def check_bool(fn: str, name: str, value) -> bool:
    """``value`` as a bool; a ``ValueError`` naming ``fn`` and ``name`` unless it is a real bool
    (``True``/``False`` or a numpy bool). ``"False"``, ``0``, ``1`` or ``None`` are refused, never
    taken for their truth value (``"False"`` is true)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{fn}: {name} must be True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


def check_axes(fn: str, axis_name) -> tuple:
    """``axis_name`` (a name, or a tuple or list of names) as a tuple; a ``ValueError`` if empty
    (a mean over no axis would leave every rank with its own gradient: replicas would drift) or
    if a name is ``None``, a nested sequence or not hashable (no mesh axis is called that)."""
    result = compat.axes_tuple(axis_name)
    if not result:
        raise ValueError(f"{fn}: axis_name must name at least one mapped axis to average over, "
                         f"got {axis_name!r}; e.g. 'data', or ('data', 'replica') for several")
    for name in result:
        if name is None or isinstance(name, (tuple, list, dict, set)) or not isinstance(name, Hashable):
            raise ValueError(f"{fn}: axis_name must be a mesh axis name (e.g. 'data') or a tuple of them, "
                             f"got {axis_name!r}")
    return result


DEFAULT_TIMEOUT_S = 300.0
# Timeouts become integer milliseconds: anything finite up to ~30 years; inf or 1e300 would overflow.
MAX_TIMEOUT_S = 1e9


def timeout_seconds(timeout_s: float | None, env: str, api: str, *, default: float = DEFAULT_TIMEOUT_S,
                    name: str = "the timeout", zero_is_off: bool = False) -> float:
    """``timeout_s``, else ``$env``, else ``default``: a number of seconds in (0, MAX_TIMEOUT_S]
    (with ``zero_is_off``, in [0, MAX_TIMEOUT_S], 0 turning off what it times). ``name`` is the
    timeout as the errors call it."""
    lowest, off = (">= 0", " (0 turns it off)") if zero_is_off else ("> 0", "")
    given = f"{api}: {name}"
    if timeout_s is None:
        raw = os.environ.get(env, "")
        if not raw.strip():
            return default
        try:
            timeout_s = float(raw)
        except ValueError:
            raise ValueError(f"{env}={raw!r} is not a number of seconds; use a number {lowest} and at most "
                             f"{MAX_TIMEOUT_S:g}, e.g. 600{off} (unset: {default:g})") from None
        given = f"{api}: {env}={raw!r}: {name}"
    above_lowest = 0 <= timeout_s if zero_is_off else 0 < timeout_s
    if not (above_lowest and timeout_s <= MAX_TIMEOUT_S):  # also refuses NaN and inf
        raise ValueError(f"{given} must be {lowest} and at most {MAX_TIMEOUT_S:g} seconds{off}, got {timeout_s!r}")
    return float(timeout_s)
