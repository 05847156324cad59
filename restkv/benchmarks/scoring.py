"""Scores of run folders, and the plain-text tables the evaluators print."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], first: str = "run") -> str:
    """A plain-text table; numbers with 2 decimals, missing or NaN cells as '-'."""

    def cell(value: Any) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    header = [first, *columns]
    body = [[cell(row.get(name)) for name in header] for row in rows]
    widths = [max(len(str(h)), *(len(line[i]) for line in body)) for i, h in enumerate(header)]
    lines = ["  ".join(str(h).ljust(w) if i == 0 else str(h).rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    for line in body:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
    return "\n".join(lines)
