"""One driver per sweep: an exclusive lock file in the sweep folder, kept fresh by a heartbeat (docs/design.md, the
lock row). Two drivers on one sweep (a job resubmitted after Ctrl-C only stopped its log tail, a second terminal)
would run every trial twice in the same folders and delete each other's replay chunks."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import psutil

from qed_ray.records.codec import RecordError, dump, load_json, parse, write_record
from qed_ray.records.sweep import LockInfo

HEARTBEAT_S = 30.0
STALE_AFTER_S = 120.0


class LockHeld(RuntimeError):
    """Another live driver holds the sweep's lock; the message names it."""


class LockLost(RuntimeError):
    """The sweep's lock names another driver now: this driver (and its trials) must stop; the message says why."""


class LockDamaged(LockHeld):
    """``sweep.lock`` is there but holds no lock record; the message names the file and the problem. ``mtime`` is
    the file's modification time, None for a folder or a dangling symbolic link (never taken over)."""

    def __init__(self, problem: str, mtime: float | None):
        super().__init__(problem)
        self.mtime = mtime


def read_lock(path: Path) -> LockInfo | None:
    """None if missing or empty (between its ``O_EXCL`` create and first write); LockDamaged naming the problem."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    if path.is_file() and st.st_size == 0:
        return None
    try:
        return parse(LockInfo, load_json(path), path)
    except RecordError as e:
        return _damaged(path, str(e))


def _damaged(path: Path, problem: str) -> None:
    try:
        mtime = path.stat().st_mtime if path.is_file() else None
    except OSError:
        mtime = None
    raise LockDamaged(problem, mtime)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def pid_reused(pid: int, started: float) -> bool:
    """Whether the live process ``pid`` started after ``started``: the pid was reused (across a reboot, say)."""
    try:
        return psutil.Process(pid).create_time() > started + 1.0
    except (psutil.Error, OSError):
        return False  # cannot tell: a live pid counts as the holder


def stale_reason(info: LockInfo | None, mtime: float, now: float, host: str, stale_after_s: float) -> str | None:
    """Why a lock may be taken over, or None while its holder may still run (on this host the pid decides)."""
    if info is None:
        return f"an unreadable lock file, untouched for {now - mtime:.0f} s" if now - mtime > stale_after_s else None
    if info.host == host:
        if not pid_alive(info.pid):
            return f"its driver (pid {info.pid} on this host) is gone"
        if pid_reused(info.pid, info.started):
            return f"its driver (pid {info.pid} on this host) is gone (that pid is another process now)"
        return None
    # The file's mtime is when its last heartbeat was written: the heartbeat its record claims is capped at it (one
    # dated later, by a clock ahead or an edit, would keep a dead driver's lock held for good), so the mtime decides.
    silent = now - mtime
    if silent > stale_after_s:
        return f"its driver (pid {info.pid} on host {info.host}) sent no heartbeat for {silent:.0f} s"
    return None


def _holder(path: Path) -> LockInfo | None:
    """None where the file is missing, empty or damaged (named when a driver tries to take it over)."""
    try:
        return read_lock(path)
    except LockDamaged:
        return None


def check_holder(path: Path, token: str | None) -> None:
    """A trial's fence: raises :class:`LockLost` when ``path`` names a driver other than the one of ``token``
    (None: no fence; a missing or half-written file does not count as another driver)."""
    if token is None:
        return
    info = _holder(path)
    if info is not None and info.token != token:
        raise LockLost(f"{path} now belongs to another driver, {info.describe(time.time())}")


class SweepLock:
    """The exclusive lock of one sweep folder, held from :meth:`acquire` to :meth:`release` (or a ``with`` block)."""

    def __init__(self, path: str | os.PathLike, heartbeat_s: float = HEARTBEAT_S,
                 stale_after_s: float = STALE_AFTER_S, log: Callable[[str], None] = print):
        self.path, self.heartbeat_s, self.stale_after_s, self.log = Path(path), heartbeat_s, stale_after_s, log
        self.host = socket.gethostname()
        self.info: LockInfo | None = None
        self.lost = threading.Event()  # set when another driver took the lock over, or heartbeats kept failing
        self.why = ""  # why it was lost
        self._written = 0.0  # when the file last got a heartbeat (time.time())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "SweepLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        """Creates the lock file, taking over a stale one; raises :class:`LockHeld` naming a live holder."""
        now = time.time()
        self.info = LockInfo(host=self.host, pid=os.getpid(), started=now, heartbeat=now, token=uuid.uuid4().hex)
        for _ in range(5):  # a takeover race with a third driver may need a second look
            if self._create():
                self._written = time.time()
                self._start_heartbeat()
                return
            self._take_over_if_stale()
        raise LockHeld(f"{self.path}: could not be created (other drivers keep taking it)")

    def refuse_if_held(self) -> None:
        """Raises LockHeld, as :meth:`acquire` would, while a live driver holds the lock; writes nothing."""
        if os.path.lexists(self.path):
            self._stale_lock()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            if self.info is not None and self._owns():
                self.path.unlink(missing_ok=True)
        except OSError as e:  # the disk that failed the heartbeats: the next start sees a stale lock
            self.log(f"WARNING: could not remove {self.path}: {e}")
        self.info = None

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(dump(self.info)))
            f.flush()
            os.fsync(f.fileno())
        return True

    def _stale_lock(self) -> tuple[bytes, str] | None:
        """The bytes of the lock file when it is stale (to take over) and why it is; None when it is gone. Raises
        LockHeld while a live driver holds it, or a folder or dangling link stands in its place. Reads only."""
        try:
            holder, damage = read_lock(self.path), None
        except LockDamaged as e:
            if e.mtime is None:
                raise LockHeld(f"{e}; no driver writes that: remove it (after making sure no driver runs this "
                               f"sweep)") from None
            holder, damage = None, e
        try:
            seen, mtime = self.path.read_bytes(), self.path.stat().st_mtime
        except FileNotFoundError:
            return None  # released meanwhile: try to create it again
        now = time.time()
        reason = stale_reason(holder, mtime, now, self.host, self.stale_after_s)
        if reason is None:
            who = holder.describe(now) if holder else f"which is starting or left it damaged ({damage})" if damage \
                else "which is starting"
            raise LockHeld(f"{self.path}: this sweep is being run by another driver, {who}; wait for it to end, or "
                           f"stop it (Ctrl-C in its terminal, `fg` first if it was stopped with Ctrl-Z, or `ray job "
                           f"stop` for a submitted job)")
        return seen, reason + (f" ({damage})" if damage else "")

    def _take_over_if_stale(self) -> None:
        stale = self._stale_lock()
        if stale is None:
            return
        seen, why = stale
        aside = self.path.with_name(f".{self.path.name}.stale-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if aside.read_bytes() != seen:  # a new holder replaced the stale file between our look and the rename
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            aside.unlink(missing_ok=True)
            raise LockHeld(f"{self.path}: another driver took this sweep over just now; wait for it to end")
        aside.unlink(missing_ok=True)
        self.log(f"taking over the sweep's stale lock: {why}")

    def _owns(self) -> bool:
        try:
            current = read_lock(self.path)
        except LockDamaged:
            return False
        return current is not None and self.info is not None and current.token == self.info.token

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="qed-sweep-lock-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s) and self.beat():
            pass

    def beat(self) -> bool:
        """One heartbeat: rewrites the file with the current time. False, with :attr:`lost` set and :attr:`why`
        saying why, if another driver has taken the lock over meanwhile, or if no heartbeat could be written for half
        of ``stale_after_s``."""
        if self.lost.is_set() or self.info is None:
            return False
        current = _holder(self.path)  # None: missing, empty or damaged
        if self._taken_by(current):
            return False
        if current is None and not os.path.lexists(self.path):
            return self._lose(f"{self.path} was removed, so another driver may start this sweep")
        self.info = self.info.model_copy(update={"heartbeat": time.time()})
        try:
            write_record(self.path, self.info, indent=None)
        except OSError as e:  # a full or unreachable disk: fail before anyone may take the sweep over
            silent = time.time() - self._written
            if silent > self.stale_after_s / 2:
                return self._lose(f"could not write a heartbeat to {self.path} for {silent:.0f} s ({e}); another "
                                  f"driver may take this sweep over")
            self.log(f"WARNING: could not refresh {self.path}: {e}")
            return True
        self._written = time.time()
        # A takeover that landed while this one wrote: the other driver holds it now.
        return not self._taken_by(_holder(self.path))

    def _taken_by(self, holder: LockInfo | None) -> bool:
        if holder is None or holder.token == self.info.token:
            return False
        self._lose(f"{self.path} now belongs to another driver, {holder.describe(time.time())}, which presumed this "
                   f"one dead")
        return True

    def _lose(self, why: str) -> bool:
        self.why = why
        self.lost.set()
        self.log(f"WARNING: {why}; stopping this driver")
        return False
