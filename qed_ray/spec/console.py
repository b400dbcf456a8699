"""Line width of what the commands print: the terminal's width on a terminal, :data:`PIPE_WIDTH` columns otherwise
(a log file, a CI console, ``ray job submit``'s stream), and :func:`fit`, which wraps what is wider."""

from __future__ import annotations

import shutil
import sys
import textwrap

PIPE_WIDTH = 100  # when stdout is not a terminal: readable in a log viewer, a CI page or a 100-column editor
MIN_WIDTH = 40  # below this a table would wrap into one column per line: wider lines read better


def width(stream=None) -> int:
    """Columns to print in: the terminal's (``COLUMNS`` first, as :func:`shutil.get_terminal_size` reads it) when
    ``stream`` (default stdout) is a terminal, else :data:`PIPE_WIDTH`."""
    stream = sys.stdout if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return max(MIN_WIDTH, shutil.get_terminal_size((PIPE_WIDTH, 24)).columns)
    return PIPE_WIDTH


def fit(text: str, columns: int) -> str:
    """``text`` with every line wider than ``columns`` wrapped at spaces; a continuation is indented two columns past
    its line's own indentation (a word longer than a line, a path say, stands whole on a line of its own, so that it
    can still be copied)."""
    out = []
    for line in text.splitlines():
        if len(line) <= columns:
            out.append(line)
            continue
        indent = line[:len(line) - len(line.lstrip())]
        out += textwrap.wrap(line, columns, initial_indent="", subsequent_indent=indent + "  ",
                             break_on_hyphens=False, break_long_words=False, drop_whitespace=True) or [line]
    return "\n".join(out)


def show_bytes(n: float) -> str:
    """``1.5 GiB``, ``728.0 MiB``, ``3.3 TiB``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n / 2**10:,.1f} KiB"
