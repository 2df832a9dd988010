"""tc's rate syntax (tc(8)), parsed in one place: the cost model's ``--link`` and the emulated links
of ``benchmarks/netem/run.py`` read a rate the way ``tc`` itself does."""

from __future__ import annotations

import argparse
import re

__all__ = ["UNLIMITED", "tc_rate_bits"]

# What means "no limit": tc has no word for it; these are ours ("0": a rate of nothing is no shaping).
UNLIMITED = ("unlimited", "none", "off", "inf", "0")

# tc's rate units: SI and IEC bits per second, and bytes per second ("bps" is bytes!).
_UNITS = {
    "": 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
    "kibps": 8 * 2**10, "mibps": 8 * 2**20, "gibps": 8 * 2**30, "tibps": 8 * 2**40,
}


def tc_rate_bits(text: str) -> float | None:
    """A tc rate in bits per second; None for no limit (:data:`UNLIMITED`).

    Args:
      text: a rate as ``tc`` writes it, any case: ``"1gbit"``, ``"10Gbit"``, ``"500mbit"``,
        ``"1mibit"``, ``"125mbps"`` (tc's ``bps`` is bytes per second), a bare number (bits per
        second), or ``"unlimited"``.

    Returns:
      The rate in bits per second, or None for no limit.

    Raises:
      argparse.ArgumentTypeError: ``text`` is not a tc rate above 0 (it names what is accepted).
    """
    t = text.strip().lower()
    if t in UNLIMITED:
        return None
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)", t)
    if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a tc rate (e.g. 1gbit, 10gbit, 500mbit, 125mbps) or 'unlimited'")
    return float(m.group(1)) * _UNITS[m.group(2)]
