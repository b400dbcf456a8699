"""Processes seen through /proc, for the tests that find a driver's trial workers or a server's children."""

from __future__ import annotations

import os
from pathlib import Path


def cmdline(pid: int) -> str:
    """The process's command line with spaces between its arguments, or "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(root: int) -> set[int]:
    """Every process below ``root`` (children, their children, ...), from one read of /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, grew = {root}, True
    while grew:
        children = {p for p, pp in parents.items() if pp in found} - found
        found |= children
        grew = bool(children)
    return found - {root}
