"""The checkpoint writer thread: jobs off the calling thread, in order, one write per folder in flight, errors
raised once on the caller's side, everything flushed on close."""

import threading
import time

import pytest

from qed_ray.records.writer import BackgroundWriter


def test_jobs_run_off_the_caller_thread_in_order_and_flush_waits(tmp_path):
    seen = []
    with BackgroundWriter() as writer:
        def job(tag, delay):
            time.sleep(delay)
            seen.append((tag, threading.current_thread().name))
        writer.submit(tmp_path / "a", lambda: job("a", 0.2))
        writer.submit(tmp_path / "b", lambda: job("b", 0.0))
        assert seen == [], "submit returns before a slow job is done"
        writer.flush()
        assert [t for t, _ in seen] == ["a", "b"]
        assert all(name.startswith("checkpoint-writer") for _, name in seen)
        writer.submit(tmp_path / "c", lambda: job("c", 0.1))
    assert [t for t, _ in seen] == ["a", "b", "c"], "close flushes"


def test_a_second_write_of_a_folder_waits_for_the_first(tmp_path):
    times = {}
    writer = BackgroundWriter()

    def slow():
        time.sleep(0.3)
        times["first ends"] = time.monotonic()

    writer.submit(tmp_path / "ckpt", slow)
    writer.submit(tmp_path / "other", lambda: None)
    times["other queued"] = time.monotonic()
    writer.submit(tmp_path / "ckpt" / ".." / "ckpt", lambda: None)  # the same folder
    times["second queued"] = time.monotonic()
    writer.close()
    assert times["other queued"] < times["first ends"] <= times["second queued"]


def test_a_failed_write_is_raised_once_on_the_callers_side(tmp_path):
    writer = BackgroundWriter()

    def broken():
        raise OSError("disk full")

    writer.submit(tmp_path / "a", broken)
    with pytest.raises(OSError, match="disk full"):
        writer.flush()
    writer.flush()  # raised once
    done = []
    writer.submit(tmp_path / "a", broken)
    time.sleep(0.2)
    with pytest.raises(OSError, match="disk full"):
        writer.submit(tmp_path / "b", lambda: done.append("b"))  # nothing is queued after a failure
    writer.close()
    assert done == []
