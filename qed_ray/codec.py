"""The one JSON codec of the files the service writes and reads back: strict JSON (no NaN or inf, which JSON does not
have) and its inverse for numbers."""

from __future__ import annotations

import math


def strict_json(x):
    """NaN/inf -> None, dict keys -> str, tuples -> lists, recursively (``json.dumps`` then writes strict JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): strict_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict_json(v) for v in x]
    return x


def from_strict(x):
    """Inverse of :func:`strict_json` for numbers: None -> NaN, recursively (every result value is numeric)."""
    if x is None:
        return math.nan
    if isinstance(x, list):
        return [from_strict(v) for v in x]
    return x
