"""Formatting shared by the sweep and merge reports: numbers, spreads, CSV and JSON values."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence

from mergekit_loco.compare.stats import Spread


def format_number(value: float | None, digits: int = 4) -> str:
    """``-`` for missing (None, nan), ``failed`` for inf, else fixed ``digits``."""
    if value is None or math.isnan(value):
        return "-"
    if math.isinf(value):
        return "failed"
    return f"{value:.{digits}f}"


def format_loss(loss: Spread) -> str:
    """``mean ± std`` (one value: the value)."""
    if not math.isfinite(loss.mean) or loss.n < 2:
        return format_number(loss.mean)
    return f"{loss.mean:.4f} ± {loss.std:.4f}"


def csv_text(rows: Sequence[dict], columns: Sequence[str]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(
        buffer, fieldnames=list(columns), lineterminator="\n", extrasaction="ignore"
    )
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def json_value(value):
    """JSON has no inf/nan: write them as the strings "inf" / null."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, float) and math.isnan(value):
        return None
    return value
