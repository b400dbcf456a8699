"""Processes of the end-to-end tests: free ports, processes seen through /proc, and a CLI call in a fresh
interpreter that reports which heavy modules it imported."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cmdline(pid: int) -> str:
    """The process's command line with spaces between its arguments, or "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first, then the parent's pid, ...; the
    start time is index 19), or [] once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def descendants(root: int) -> set[int]:
    """Every process below ``root`` (children, their children, ...), from one read of /proc."""
    parents = {int(e): stat_fields(int(e)) for e in os.listdir("/proc") if e.isdigit()}
    parents = {pid: int(fields[1]) for pid, fields in parents.items() if fields}
    found, grew = {root}, True
    while grew:
        children = {p for p, pp in parents.items() if pp in found} - found
        found |= children
        grew = bool(children)
    return found - {root}


def lone_trial_process(root: int) -> int | None:
    """The pid of the one Tune trial process (``ray::ImplicitFunc``) below ``root`` (a driver with its own Ray, or
    a node's raylet); None while there is none or more than one."""
    found = [pid for pid in descendants(root) if cmdline(pid).startswith("ray::ImplicitFunc")]
    return found[0] if len(found) == 1 else None


HEAVY = ("torch", "ray", "ray.tune", "mlflow")  # what a CLI call that only reads or refuses must not import
_PROBE = """import atexit, json, os, runpy, sys
atexit.register(lambda: json.dump(sorted(m for m in sys.modules if m in {heavy}),
                                  open(os.environ["QED_TEST_LOADED"], "w")))
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def cli_run(tmp: Path, module: str, *args: str, env: dict | None = None, cwd: Path | None = None,
            timeout: float = 120) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``python -m module args`` in a fresh interpreter (``env`` added to this one's environment), and which of
    :data:`HEAVY` it had imported when it exited (``tmp``: a folder for that list)."""
    loaded = Path(tmp) / "loaded.json"
    proc = subprocess.run([sys.executable, "-c", _PROBE.format(heavy=set(HEAVY)), module, *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {}), "QED_TEST_LOADED": str(loaded)})
    return proc, json.loads(loaded.read_text()) if loaded.exists() else []
