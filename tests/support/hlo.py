"""Reading a compiled program's HLO text: which collectives it holds."""

import re

_COLLECTIVE = re.compile(r"=\s*(?P<type>.*?)\s(?P<op>all-gather|all-reduce|reduce-scatter|all-to-all)(?:-start)?\(")


def collectives(text: str, op: str) -> list[tuple[str, str]]:
    """``(result type, line)`` of every ``op`` (``all-gather``, ``all-reduce``, ...) in ``text``."""
    out = []
    for line in text.splitlines():
        m = _COLLECTIVE.search(line)
        if m and m.group("op") == op:
            out.append((m.group("type"), line.strip()))
    return out


def float_all_gathers(text: str) -> list[str]:
    """The all-gathers of floating-point values (a gradient or parameter gathered whole); the
    compressed exchange gathers packed bytes (``u8``)."""
    return [line for kind, line in collectives(text, "all-gather") if re.search(r"\b(f32|f16|bf16|f64)\[", kind)]
