"""The one reader of the files the service reads back (records, metrics lines, snapshots, the results key, Tune's
error files): a regular file only, within a size limit of its kind, and through a symbolic link only where the link
stays inside the file's own folder (or the folder the caller names, such as the sweep folder)."""

from __future__ import annotations

import hashlib
import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
# The largest file of each kind the service reads back, with what it is called in a refusal. A record's limit
# holds sweep.json of the 100,000-trial cap; a snapshot's a pack's policy weights many times over.
LIMITS: dict[str, tuple[int, str]] = {
    "record": (256 * MIB, "a record file"),
    "lines": (1 * GIB, "a metrics file"),
    "snapshot": (16 * GIB, "a snapshot file"),
    "key": (4 * KIB, "a results key file"),
    "error": (64 * KIB, "the read of an error file"),  # read from its end: only the last lines are shown
}
ERROR_LINE = 300  # characters of an error line shown (--status, the summary); a file's line may be megabytes


def _not_regular(mode: int) -> str | None:
    """What a file that is not a regular file is, as a refusal says it; None for a regular file."""
    for test, what in ((stat.S_ISDIR, "a folder, not a file"),
                       (stat.S_ISFIFO, "a FIFO (named pipe), not a regular file"),
                       (stat.S_ISCHR, "a character device, not a regular file"),
                       (stat.S_ISBLK, "a block device, not a regular file"),
                       (stat.S_ISSOCK, "a socket, not a regular file")):
        if test(mode):
            return what
    return None if stat.S_ISREG(mode) else "not a regular file"


def _target(path: Path, within: str | os.PathLike | None, error: type[Exception]) -> Path:
    """The regular file ``path`` names: itself, or the target of a link that stays inside ``within`` (default: the
    link's own folder); raises ``error`` naming the file otherwise."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise error(f"{path}: missing") from None
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or e})") from None
    if stat.S_ISLNK(info.st_mode):
        target = Path(os.path.realpath(path))
        if not os.path.exists(target):
            raise error(f"{path}: a dangling symbolic link (to {os.readlink(path)}), not a file")
        bound = Path(os.path.realpath(within if within is not None else path.parent))
        if not target.is_relative_to(bound):
            raise error(f"{path}: a symbolic link to {target}, outside {bound}; refusing to follow it (put the file "
                        f"itself there)")
        info = os.stat(target)
        path = target
    what = _not_regular(info.st_mode)
    if what:
        raise error(f"{path}: {what}")
    return path


@contextmanager
def open_regular(path: str | os.PathLike, kind: str, error: type[Exception],
                 within: str | os.PathLike | None = None) -> Iterator[BinaryIO]:
    """The file opened for reading (binary) once it is known to be a regular file within ``kind``'s size limit
    (:data:`LIMITS`); raises ``error`` with one line naming the file otherwise (module notes)."""
    path = Path(path)
    limit, label = LIMITS[kind]
    target = _target(path, within, error)
    try:
        fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        what = _not_regular(info.st_mode)
        if what:
            raise error(f"{path}: {what}")
        if info.st_size > limit and kind != "error":
            raise error(f"{path}: {info.st_size:,} bytes, more than the {limit:,} {label} may have (is it the right "
                        f"file?)")
        os.set_blocking(fd, True)
        yield f


def read_bytes(path: str | os.PathLike, kind: str, error: type[Exception],
               within: str | os.PathLike | None = None) -> bytes:
    """The whole file (:func:`open_regular`); a file that grew past the limit while it was read is refused too."""
    limit, label = LIMITS[kind]
    try:
        with open_regular(path, kind, error, within) as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or e})") from None
    if len(data) > limit:
        raise error(f"{path}: more than the {limit:,} bytes {label} may have (is it the right file?)")
    return data


def read_tail(path: str | os.PathLike, error: type[Exception], within: str | os.PathLike | None = None) -> str:
    """The last :data:`LIMITS` ``["error"]`` bytes of a text file (an error log may be of any length), as text."""
    limit = LIMITS["error"][0]
    try:
        with open_regular(path, "error", error, within) as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - limit))
            return f.read(limit).decode(errors="replace")
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or e})") from None


def file_sha256(path: str | os.PathLike, error: type[Exception], within: str | os.PathLike | None = None) -> str:
    """SHA-256 of a snapshot file's bytes, hex (streamed; within the snapshot limit)."""
    limit, label = LIMITS["snapshot"]
    h, seen = hashlib.sha256(), 0
    try:
        with open_regular(path, "snapshot", error, within) as f:
            for block in iter(lambda: f.read(MIB), b""):
                seen += len(block)
                if seen > limit:
                    raise error(f"{path}: more than the {limit:,} bytes {label} may have (is it the right file?)")
                h.update(block)
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or e})") from None
    return h.hexdigest()


def cut(line: str, limit: int = ERROR_LINE) -> str:
    """``line`` on one line and at most ``limit`` characters (the middle left out, marked with its length)."""
    line = " ".join(line.split())
    if len(line) <= limit:
        return line
    keep = (limit - 30) // 2
    return f"{line[:keep]} ...[{len(line) - 2 * keep:,} characters]... {line[-keep:]}"
