"""A run folder's status as the commands read it (``status.json``, written by wanexp.callbacks.status_file): the
record, the training time over all sessions, and whether a ``running`` run is still alive. Shared by
``wanexp-status`` (wanexp.cli.status) and its live page (wanexp.cli.status_server)."""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

STALE_S = 600  # seconds without an update after which a running run is shown stale


def run_seconds(s: dict) -> float | None:
    """The run's training time over all its sessions (a status.json without it: its session's)."""
    return s.get("elapsed_total_s", s.get("elapsed_s"))


def read_status(run: Path) -> dict:
    try:
        return json.loads((run / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def live_state(s: dict, now: float | None = None) -> str:
    """The state as recorded, or ``dead``/``stale`` for a ``running`` run that no longer updates."""
    state = s.get("state") or "not started"
    if state != "running":
        return state
    pid, host = s.get("pid"), s.get("host")
    if pid and host == socket.gethostname():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return "dead"
        except PermissionError:
            pass
    if (now or time.time()) - float(s.get("updated") or 0) > STALE_S:
        return "stale"
    return state
