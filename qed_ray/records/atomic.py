"""Atomic, durable writes: the one helper behind every file and folder the project writes in place."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator

TMP_MARK = ".tmp-"


def fsync_dir(path: str | os.PathLike) -> None:
    """Makes a folder's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError:  # some network and FUSE filesystems refuse fsync on a folder; the rename itself still holds
        pass
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    """Flushes a file's data to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary path beside ``path`` (same suffix); when the block succeeds, the file written there is
    fsynced and renamed over ``path``.

    Example: ``with atomic_file(p) as tmp: np.savez(tmp, **arrays)``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}{TMP_MARK}{uuid.uuid4().hex[:8]}{path.suffix}")
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Atomically replaces ``path`` with ``data``."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Atomically replaces ``path`` with ``text`` (UTF-8)."""
    write_bytes(path, text.encode())


def write_json(path: str | os.PathLike, obj: Any, **dumps_kwargs) -> None:
    """Atomically replaces ``path`` with ``json.dumps(obj, **dumps_kwargs)``."""
    write_text(path, json.dumps(obj, **dumps_kwargs))


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yields an empty staging folder beside ``path``; when the block succeeds, every file in it is fsynced and
    the folder takes the place of ``path`` (an existing ``path`` is replaced, see :func:`replace_dir`)."""
    staging = staging_dir(path)
    try:
        yield staging
        publish_dir(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def staging_dir(path: str | os.PathLike) -> Path:
    """A new empty staging folder beside ``path`` (named ``.<name>.tmp-*``, so no reader takes it for ``path``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{path.name}{TMP_MARK}", dir=path.parent))


def publish_dir(staging: str | os.PathLike, path: str | os.PathLike) -> None:
    """Fsyncs every file in ``staging`` (from :func:`staging_dir`), then puts it in the place of ``path``: the
    second half of :func:`atomic_dir`, for a folder written by another thread."""
    for dirpath, _, files in os.walk(staging):
        for name in files:
            fsync_file(Path(dirpath) / name)
        fsync_dir(dirpath)
    replace_dir(staging, path)


def replace_dir(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Puts folder ``src`` in the place of ``dst`` by renames on one filesystem; a previous ``dst`` is deleted.

    Between the two renames ``dst`` is briefly absent while the previous version sits beside it as
    ``.<name>.old-<hex>``: :func:`recover_dir` puts it back after a crash in that window.
    """
    src, dst = Path(src), Path(dst)
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(dst, old)
    os.replace(src, dst)
    fsync_dir(dst.parent)
    if old is not None:
        shutil.rmtree(old)


def recover_dir(dst: str | os.PathLike) -> bool:
    """If ``dst`` is missing but a previous version set aside by :func:`replace_dir` exists, renames it back.

    Returns True when it recovered one.
    """
    dst = Path(dst)
    if dst.exists() or not dst.parent.is_dir():
        return False
    olds = sorted(dst.parent.glob(f".{dst.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if not olds:
        return False
    os.replace(olds[-1], dst)
    fsync_dir(dst.parent)
    return True
