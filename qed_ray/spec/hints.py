"""Error text about user input, bounded and helpful: short reprs, did-you-mean suggestions, a linear duplicate check.

A message quotes what the user wrote, and what they wrote may be a megabyte string or a huge list; every quote goes
through :func:`short_repr`, so a message stays a line however large the input.
"""

from __future__ import annotations

import difflib
import reprlib
from collections import Counter
from typing import Any, Hashable, Iterable


def _repr() -> reprlib.Repr:
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlong = 2, 60, 60, 40
    r.maxlist = r.maxtuple = r.maxset = r.maxfrozenset = r.maxdeque = 6
    r.maxdict = 4
    return r


_REPR = _repr()


def short_repr(value: Any) -> str:
    """``repr(value)`` cut to a few dozen characters: long strings, lists and mappings end in ``...``."""
    try:
        return _REPR.repr(value)
    except ValueError:  # an int past Python's 4,300-digit limit for conversion to text
        return f"<an integer of about {int(value.bit_length() * 0.30103) + 1:,} digits>"


def short_text(text: str, limit: int = 60) -> str:
    """``text`` itself (not its repr) when short, else its start and ``...`` (for keys and names in paths)."""
    return text if len(text) <= limit else text[:limit] + "..."


def close_match(word: Any, choices: Iterable[Any]) -> str | None:
    """The choice closest to ``word`` when one is close (difflib's ratio >= 0.6), else None."""
    text = str(word)
    if len(text) > 100:  # difflib is quadratic in the length; no real name is this long
        return None
    by_text = {str(c): c for c in choices}
    found = difflib.get_close_matches(text, list(by_text), n=1)
    return found[0] if found else None


def did_you_mean(word: Any, choices: Iterable[Any]) -> str:
    """``"; did you mean 'eval_every'?"`` for the closest choice, or "" when none is close."""
    match = close_match(word, choices)
    return f"; did you mean {match!r}?" if match is not None else ""


def near(word: Any, choices: Iterable[Any]) -> str:
    """`` (did you mean 'cheetah-run'?)`` for the closest choice, or "" (for the middle of a sentence)."""
    match = close_match(word, choices)
    return f" (did you mean {match!r}?)" if match is not None else ""


def duplicates(items: Iterable[Hashable]) -> list:
    """The items that occur more than once, in order of first occurrence; one hash per item (linear)."""
    counts = Counter(items)
    return [item for item, n in counts.items() if n > 1]
