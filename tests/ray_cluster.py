"""Real Ray clusters for the slow tests, isolated from every other Ray user of this machine.

Every cluster gets ``RAY_TMPDIR``/``--temp-dir`` under a fresh short folder (unix sockets cap paths at ~107 chars), so
``ray.init()`` never finds someone else's cluster through ``/tmp/ray/ray_current_cluster`` and nothing here writes
that file; clean-up kills only processes whose command line names that folder (and their children), never
``ray stop``. Every cluster runs with Ray token auth (the session's throwaway token, conftest.py), never with auth
disabled: these ports listen on all interfaces.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from kit import cmdline, descendants, free_port, stat_fields
from sweep_helpers import cli_env

RAY = str(Path(sys.executable).with_name("ray"))
HEAD_RESOURCE = "node:__internal_head__"


@contextmanager
def short_tmp():
    """A fresh ``/tmp/qmnXXXX`` (short: Ray's socket paths live under it); its processes are killed at exit."""
    tmp = Path(tempfile.mkdtemp(prefix="qmn", dir="/tmp"))
    try:
        yield tmp
    finally:
        kill_processes_naming(str(tmp))
        shutil.rmtree(tmp, ignore_errors=True)


def processes_naming(token: str) -> set[int]:
    """Processes whose command line contains ``token`` or that hold a file open under it, plus all their descendants
    (Ray renames its workers and agents to ``ray::...``, so those are found through their raylet; the client server
    that ``ray start`` leaves behind names no folder and is nobody's child, but writes its logs under it)."""
    me = os.getpid()
    found = {int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me
             and (token in cmdline(int(p)) or _holds_file_under(int(p), token))}
    return found.union(*(descendants(p) for p in found)) - {me}


def _holds_file_under(pid: int, token: str) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    inside = token.rstrip("/") + "/"
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(inside):
                return True
        except OSError:
            pass
    return False


def kill_processes_naming(token: str, grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``, every process of ``processes_naming(token)``, and at the SIGKILL those
    found at the SIGTERM that no longer look like it. (A test's cluster keeps nothing worth a longer grace: its
    folder is deleted next.)"""
    found: dict[int, str] = {}  # pid -> its start time, so that a reused pid is never signalled
    for sig in (signal.SIGTERM, signal.SIGKILL):
        found.update({pid: _started(pid) for pid in processes_naming(token)})
        for pid, started in found.items():
            if started and _started(pid) == started:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.time() + grace_s
        while any(_started(pid) == started for pid, started in found.items() if started) and time.time() < deadline:
            time.sleep(0.2)


def _started(pid: int) -> str:
    """The process's start time, or "" once it is gone (zombies count as gone)."""
    fields = stat_fields(pid)
    return fields[19] if fields and fields[0] != "Z" else ""


def ray_env(tmp: Path, address: str | None = None, **extra) -> dict:
    """The environment of every Ray process and sweep driver of a cluster: its temp dir, token auth with the
    session's throwaway token, and its address (a driver given one joins that cluster instead of starting its own)."""
    return cli_env(RAY_TMPDIR=str(tmp), **({"RAY_ADDRESS": address} if address else {}), **extra)


def start_head(tmp: Path, *args: str) -> str:
    """Starts a head node with ``ray start --head`` (its files under ``tmp / "ray"``, no dashboard, free ports; extra
    ``ray start`` arguments in ``args``) and returns its address."""
    port = free_port()
    head = subprocess.run([RAY, "start", "--head", f"--port={port}", "--include-dashboard=false",
                           f"--ray-client-server-port={free_port()}", f"--dashboard-port={free_port()}",
                           f"--dashboard-agent-listen-port={free_port()}", f"--temp-dir={tmp / 'ray'}", *args],
                          env=ray_env(tmp), capture_output=True, text=True, timeout=180)
    assert head.returncode == 0, head.stdout[-2000:] + head.stderr[-2000:]
    return f"127.0.0.1:{port}"
