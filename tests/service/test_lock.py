"""One driver per sweep: the O_EXCL lock file, its heartbeat, and when a lock is stale and taken over."""

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from qed_ray.service.lock import LockHeld, LockLost, SweepLock, check_holder, read_lock


def _write(path, **fields):
    now = time.time()
    record = {"host": socket.gethostname(), "pid": os.getpid(), "started": now, "heartbeat": now, "token": "t0",
              **fields}
    path.write_text(json.dumps(record))
    os.utime(path, (record["heartbeat"], record["heartbeat"]))  # as its holder's last heartbeat left the file
    return record


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_second_holder_is_refused_naming_the_first_and_release_frees_it(tmp_path):
    path = tmp_path / "sweep.lock"
    first = SweepLock(path)
    first.acquire()
    info = read_lock(path)
    assert (info.host, info.pid) == (socket.gethostname(), os.getpid())
    assert abs(info.heartbeat - time.time()) < 5 and info.started == info.heartbeat
    with pytest.raises(LockHeld) as checked:  # what a start checks before it joins Ray: the same refusal
        SweepLock(path).refuse_if_held()
    with pytest.raises(LockHeld) as held:
        SweepLock(path).acquire()
    message = str(held.value)
    assert str(checked.value).split("last heartbeat")[0] == message.split("last heartbeat")[0]
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in message
    assert re.search("last heartbeat [0-4] s ago", message), message
    assert read_lock(path) == info, "a refused driver leaves the holder's lock alone"
    first.release()
    assert not path.exists()
    with SweepLock(path):
        assert read_lock(path).token != info.token
    assert not path.exists()


def test_lock_of_a_dead_driver_on_this_host_is_taken_over(tmp_path):
    path = tmp_path / "sweep.lock"
    dead = _dead_pid()
    _write(path, pid=dead)
    kept = path.read_bytes()
    SweepLock(path).refuse_if_held()  # a stale lock refuses nothing, and the check leaves it as it is
    assert path.read_bytes() == kept and [p.name for p in tmp_path.iterdir()] == ["sweep.lock"]
    said = []
    with SweepLock(path, log=said.append) as lock:
        assert read_lock(path).pid == os.getpid() and read_lock(path).token == lock.info.token
    assert said == [f"taking over the sweep's stale lock: its driver (pid {dead} on this host) is gone"]
    assert not list(tmp_path.iterdir()), "no stale copy is left behind"


def test_lock_on_another_host_is_stale_only_when_its_heartbeat_is_old(tmp_path):
    path = tmp_path / "sweep.lock"
    _write(path, host="other-node", pid=1, heartbeat=time.time() - 30)  # pid 1 exists here, but on another host
    with pytest.raises(LockHeld, match=r"pid 1 on host other-node .*last heartbeat 3\d s ago"):
        SweepLock(path).acquire()
    # Its host's clock runs 10 minutes behind (an old-looking heartbeat), but the file server stamped the file now.
    _write(path, host="other-node", pid=1, heartbeat=time.time() - 600)
    os.utime(path)
    with pytest.raises(LockHeld, match="pid 1 on host other-node"):
        SweepLock(path).acquire()
    _write(path, host="other-node", pid=1, heartbeat=time.time() - 121)
    said = []
    with SweepLock(path, log=said.append):
        assert read_lock(path).host == socket.gethostname()
    assert len(said) == 1 and re.fullmatch(r"taking over the sweep's stale lock: its driver \(pid 1 on host "
                                           r"other-node\) sent no heartbeat for 12\d s", said[0]), said


def test_a_live_driver_on_this_host_is_never_taken_over_however_old_its_heartbeat(tmp_path):
    path = tmp_path / "sweep.lock"
    _write(path, pid=os.getppid(), heartbeat=time.time() - 3600)  # alive, silent for an hour (Ctrl-Z, a suspend)
    with pytest.raises(LockHeld, match=f"pid {os.getppid()} on host {socket.gethostname()} .*last heartbeat 3600 s "
                                       f"ago.*`fg` first if it was stopped with Ctrl-Z"):
        SweepLock(path).acquire()
    assert read_lock(path).pid == os.getppid(), "left as it was"
    # The same pid, but a process that started after the lock was written: the pid was reused, its driver is gone.
    _write(path, pid=os.getppid(), started=1.0, heartbeat=time.time() - 3600)
    said = []
    with SweepLock(path, log=said.append):
        assert read_lock(path).pid == os.getpid()
    assert said == [f"taking over the sweep's stale lock: its driver (pid {os.getppid()} on this host) is gone "
                    f"(that pid is another process now)"]


def test_a_half_written_lock_counts_as_held_until_it_is_old(tmp_path):
    path = tmp_path / "sweep.lock"
    path.write_text("")  # a holder between its O_EXCL create and its first write
    with pytest.raises(LockHeld, match="which is starting"):
        SweepLock(path).acquire()
    old = time.time() - 300
    os.utime(path, (old, old))
    said = []
    with SweepLock(path, log=said.append):
        pass
    assert said and said[0].startswith("taking over the sweep's stale lock: an unreadable lock file, untouched for")


def test_heartbeat_refreshes_the_file(tmp_path):
    path = tmp_path / "sweep.lock"
    with SweepLock(path, heartbeat_s=0.05) as lock:
        first = read_lock(path)
        time.sleep(0.5)
        later = read_lock(path)
        assert later.heartbeat > first.heartbeat and later.token == first.token and later.started == first.started
        assert not lock.lost.is_set()


def test_a_heartbeat_notices_that_another_driver_took_over_and_the_trials_fence_stops(tmp_path):
    path = tmp_path / "sweep.lock"
    said = []
    lock = SweepLock(path, heartbeat_s=3600, log=said.append)  # beats only when called here
    lock.acquire()
    assert lock.beat() and not said
    check_holder(path, lock.info.token)  # a trial of this driver may write
    check_holder(path, None)  # no fence
    _write(path, host="node-b", pid=77, token="someone-else")  # another driver presumed this one dead
    assert not lock.beat() and lock.lost.is_set() and not lock.beat()
    assert re.fullmatch(rf"{path} now belongs to another driver, pid 77 on host node-b \(started .*, last heartbeat "
                        rf"\d s ago\), which presumed this one dead", lock.why), lock.why
    assert said == [f"WARNING: {lock.why}; stopping this driver"]
    with pytest.raises(LockLost, match=f"^{path} now belongs to another driver, pid 77 on host node-b"):
        check_holder(path, lock.info.token)  # this driver's trials stop before they write anything more
    lock.release()
    assert read_lock(path).token == "someone-else", "release never removes another driver's lock"


def test_a_driver_that_cannot_write_its_heartbeat_fails_before_it_could_be_taken_over(tmp_path):
    path = tmp_path / "sweep.lock"
    said = []
    lock = SweepLock(path, heartbeat_s=3600, stale_after_s=0.4, log=said.append)
    lock.acquire()
    path.unlink()
    path.mkdir()  # the file cannot be replaced any more (as with a full or unreachable disk; works as root too)
    assert lock.beat() and not lock.lost.is_set(), "one failed beat is a warning"
    assert said[-1].startswith(f"WARNING: could not refresh {path}: [Errno 21] Is a directory")
    time.sleep(0.3)  # past half the takeover limit without a heartbeat
    assert not lock.beat() and lock.lost.is_set()
    assert lock.why.startswith(f"could not write a heartbeat to {path} for 0 s ([Errno 21]") and lock.why.endswith(
        "; another driver may take this sweep over")
    lock.release()


def test_a_removed_lock_stops_its_driver(tmp_path):
    path = tmp_path / "sweep.lock"
    lock = SweepLock(path, heartbeat_s=3600, log=lambda line: None)
    lock.acquire()
    path.unlink()
    assert not lock.beat() and lock.why == f"{path} was removed, so another driver may start this sweep"
    lock.release()


def test_a_future_heartbeat_counts_only_up_to_the_files_mtime(tmp_path):
    path = tmp_path / "sweep.lock"
    _write(path, host="other-node", pid=1, heartbeat=time.time() + 10 ** 8)  # a record dated years ahead
    os.utime(path, (time.time() - 121, time.time() - 121))  # but last written two minutes ago
    said = []
    with SweepLock(path, log=said.append):
        assert read_lock(path).host == socket.gethostname()
    assert len(said) == 1 and re.fullmatch(r"taking over the sweep's stale lock: its driver \(pid 1 on host "
                                           r"other-node\) sent no heartbeat for 12\d s", said[0]), said


def test_a_takeover_landing_while_a_heartbeat_is_written_is_noticed_at_once(tmp_path, monkeypatch):
    from qed_ray.service import lock as lock_module

    path = tmp_path / "sweep.lock"
    lock = SweepLock(path, heartbeat_s=3600, log=lambda line: None)
    lock.acquire()
    real = lock_module.write_record

    def then_taken_over(target, record, **kw):  # the other driver's rename lands right after this one's
        real(target, record, **kw)
        _write(path, host="node-b", pid=77, token="someone-else")

    monkeypatch.setattr(lock_module, "write_record", then_taken_over)
    assert not lock.beat() and lock.lost.is_set()
    assert lock.why.startswith(f"{path} now belongs to another driver, pid 77 on host node-b"), lock.why
    lock.release()
    assert read_lock(path).token == "someone-else"
