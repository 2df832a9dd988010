"""Printing results as a table (rich when installed, plain text otherwise) and saving them."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
        print(title)
        print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
        for r in rows:
            print("  ".join(v.rjust(w) for v, w in zip(r, widths)))
        return
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(*r)
    console = Console()
    if not console.is_terminal:
        # Logs and pipes: the table's natural width, never truncated to 80 columns.
        console = Console(width=10_000)
    console.print(table)


def save(records: list[dict], path: str) -> None:
    """Write records as JSON (``.json``) or CSV (anything else)."""
    if path.endswith(".json"):
        with open(path, "w") as f:
            json.dump(records, f, indent=2)
        return
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
