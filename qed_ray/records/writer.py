"""Checkpoint hashing and file writes off the training thread."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable


class BackgroundWriter:
    """A single writer thread with per-folder ordering and error propagation."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending: dict[Path, Future] = {}
        self._all: list[Future] = []
        self._lock = threading.Lock()

    def submit(self, folder: str | Path, job: Callable[[], object]) -> Future:
        """Queues ``job`` (which writes into ``folder``) after any unfinished job for the same folder has ended.

        Raises:
            the error of any earlier job that failed (nothing is queued then).
        """
        folder = Path(folder).resolve()
        self._raise_failed()
        with self._lock:
            previous = self._pending.get(folder)
        if previous is not None and previous.exception() is not None:  # waits: one write per folder in flight
            self._forget(previous)
            raise previous.exception()
        future = self._pool.submit(job)
        with self._lock:
            self._pending[folder] = future
            self._all = [f for f in self._all if not f.done() or f.exception() is not None] + [future]
        return future

    def flush(self) -> None:
        """Waits for every queued job; raises the first error among them."""
        with self._lock:
            futures = list(self._all)
        for f in futures:
            if f.exception() is not None:  # waits for f
                self._forget(f)
                raise f.exception()
        with self._lock:
            self._all = [f for f in self._all if not f.done()]
            self._pending = {k: f for k, f in self._pending.items() if not f.done()}

    def close(self) -> None:
        """Flushes, then stops the thread (the thread stops even if a job failed; the error is raised)."""
        try:
            self.flush()
        finally:
            self._pool.shutdown(wait=True)

    def _raise_failed(self) -> None:
        with self._lock:
            failed = [f for f in self._all if f.done() and f.exception() is not None]
        if failed:
            self._forget(failed[0])
            raise failed[0].exception()

    def _forget(self, future: Future) -> None:
        """An error is raised once."""
        with self._lock:
            self._all = [f for f in self._all if f is not future]
            self._pending = {k: f for k, f in self._pending.items() if f is not future}

    def __enter__(self) -> "BackgroundWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
