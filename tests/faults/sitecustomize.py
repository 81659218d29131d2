"""Fault injection for the runs that tests/integration/test_lifecycle.py starts (this folder is on their PYTHONPATH
only): ``WANEXP_TEST_SLOW_FSYNC=<seconds>`` makes each ``os.fsync`` wait first, so that a test can SIGKILL a run
while a checkpoint is being written (checkpoints are fsynced before their rename)."""
import os
import time

_DELAY = float(os.environ.get("WANEXP_TEST_SLOW_FSYNC") or 0)
if _DELAY:
    _fsync = os.fsync

    def _slow_fsync(fd):
        time.sleep(_DELAY)
        _fsync(fd)

    os.fsync = _slow_fsync
