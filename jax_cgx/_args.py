"""Argument checks shared across jax_cgx.

- argparse types of the command lines (``jax_cgx.bench``, ``jax_cgx.launch``): a value out of
  range is an argparse error that names the flag, before anything runs;
- :func:`check_bool`, the check of every boolean argument of a public function
  (``return_residual``, ``tiled``, ``error_feedback``, ...): only a real bool is accepted.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import numpy as np

# Widths the codec has (bits per value).
BITS = range(1, 9)


def integer(minimum: int) -> Callable[[str], int]:
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
    """A finite float >= ``minimum`` (> with ``above``)."""
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
