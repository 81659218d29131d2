"""The run-folder lock: a live holder refuses a second run, a stale one is taken over with a warning, and the
heartbeat keeps a live lock fresh on filesystems where the OS lock does not reach other hosts."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import time

import pytest

from wanexp.errors import ConfigError
from wanexp.runfolder import RunLock


def _holder(folder, **info):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".lock").write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "then",
                                              "heartbeat": time.time(), **info}))


def test_an_os_lock_held_elsewhere_refuses_with_the_holder(tmp_path):
    _holder(tmp_path, pid=4242, host="node7", started="yesterday")
    f = open(tmp_path / ".lock")
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live run (another open file description)
    try:
        with pytest.raises(ConfigError, match=r"is in use by a live run \(pid 4242 on node7, started yesterday\)"):
            RunLock(tmp_path, 600).acquire()
    finally:
        f.close()


def test_a_dead_holder_on_this_host_is_taken_over_with_a_warning(tmp_path, capsys):
    import socket

    _holder(tmp_path, pid=2**22 + 12345, host=socket.gethostname())  # no such pid; the OS lock went with it
    lock = RunLock(tmp_path, 600)
    lock.acquire()
    out = capsys.readouterr().out
    assert "taking over the stale lock" in out and "its process is gone" in out
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert (tmp_path / ".lock").read_text() == ""  # released: nothing left to take over


def test_another_hosts_lock_is_live_until_its_heartbeat_is_stale(tmp_path, capsys):
    _holder(tmp_path, pid=77, host="node3", heartbeat=time.time() - 30)
    with pytest.raises(ConfigError, match=r"in use by a live run \(pid 77 on node3"):
        RunLock(tmp_path, 600).acquire()  # the OS lock may not reach node3 (e.g. some NFS setups): trust its beat
    _holder(tmp_path, pid=77, host="node3", heartbeat=time.time() - 900)
    lock = RunLock(tmp_path, 600)
    lock.acquire()
    out = capsys.readouterr().out
    assert "taking over the stale lock" in out and "no heartbeat for 9" in out and "guard.lock_stale_s=600" in out
    lock.release()


def test_without_os_locks_a_live_pid_on_this_host_refuses(tmp_path, monkeypatch):
    import socket

    def no_flock(f, op):
        raise OSError(errno.ENOLCK, "No locks available")  # e.g. Lustre mounted without flock

    monkeypatch.setattr(fcntl, "flock", no_flock)
    _holder(tmp_path, pid=os.getppid(), host=socket.gethostname())  # alive
    with pytest.raises(ConfigError, match="in use by a live run"):
        RunLock(tmp_path, 600).acquire()
    _holder(tmp_path, pid=2**22 + 12345, host=socket.gethostname())  # dead
    lock = RunLock(tmp_path, 600)
    lock.acquire()
    lock.release()


def test_the_heartbeat_keeps_a_live_lock_fresh(tmp_path):
    lock = RunLock(tmp_path, 0.2)  # beats every 0.05 s
    lock.acquire()
    try:
        first = json.loads((tmp_path / ".lock").read_text())["heartbeat"]
        deadline = time.time() + 5
        while time.time() < deadline:
            time.sleep(0.05)
            text = (tmp_path / ".lock").read_text()
            if text and json.loads(text)["heartbeat"] > first:
                break
        else:
            raise AssertionError("no heartbeat")
    finally:
        lock.release()


def test_secrets_are_redacted_from_what_a_run_writes():
    from wanexp.train import redacted

    cfg = {"logger": {"wandb": {"project": "p", "api_key": "abc123"}}, "hub": [{"HF_TOKEN": "xyz"}], "lr": 1e-4}
    assert redacted(cfg) == {"logger": {"wandb": {"project": "p", "api_key": "***"}}, "hub": [{"HF_TOKEN": "***"}],
                             "lr": 1e-4}


def test_a_truncated_lock_record_with_the_os_lock_free_is_taken_over(tmp_path, capsys):
    """A holder killed while writing its record leaves e.g. '{"pid": 4': no live run holds the OS lock, so the
    folder is not blocked forever; a live holder (OS lock held) with such a record still refuses."""
    (tmp_path / ".lock").write_text('{"pid": 4')
    f = open(tmp_path / ".lock")
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        with pytest.raises(ConfigError, match=r"is in use by a live run \(pid \? on \?"):
            RunLock(tmp_path, 600).acquire()
    finally:
        f.close()
    lock = RunLock(tmp_path, 600)
    lock.acquire()
    out = capsys.readouterr().out
    assert "taking over the stale lock" in out and "its record is unreadable" in out, out
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()


def test_a_refused_run_removes_the_lock_and_folders_it_created(tmp_path):
    """release(discard=True): what acquire() created goes (the .lock, the new folders), what was there stays."""
    new = tmp_path / "a" / "b" / "run"
    lock = RunLock(new, 600)
    lock.acquire()
    lock.release(discard=True)
    assert list(tmp_path.iterdir()) == []
    old = tmp_path / "old"
    old.mkdir()
    (old / ".lock").write_text("")
    (old / "status.json").write_text("{}")
    lock = RunLock(old, 600)
    lock.acquire()
    lock.release(discard=True)
    assert sorted(p.name for p in old.iterdir()) == [".lock", "status.json"]
    kept = tmp_path / "kept"
    lock = RunLock(kept, 600)
    lock.acquire()
    (kept / "rejects.jsonl").write_text("")  # written meanwhile: the folder stays, the lock goes
    lock.release(discard=True)
    assert [p.name for p in kept.iterdir()] == ["rejects.jsonl"]
    lock = RunLock(tmp_path / "started", 600)
    lock.acquire()
    lock.started = True
    lock.release(discard=not lock.started)
    assert (tmp_path / "started" / ".lock").is_file()
