"""The live run page: ``wanexp-status DIR --serve`` serves a JSON API and one page over the runs under DIR.

DIR is a run folder, a sweep folder or an outputs folder (every run and sweep below it, a few levels deep). Routes
(GET and HEAD only; anything else is refused):

- ``/``: the page (wanexp.cli.status_page), polling the API every ``--every`` seconds;
- ``/api/runs``: every run with its state, step of total, progress, ETA, elapsed, losses; every sweep;
- ``/api/runs/<name>``: a run's status.json, its metric history (status.jsonl), per-rank fields, validation videos
  (step, prompt, URL), pictures (strip.png, loss.png) and rejects; for a sweep, its table of points x swept values x
  losses, each point's loss curve and the rank x lr grid of its ranking loss;
- ``/files/<path>``: a picture or video under DIR, read-only (Range requests served, for the video player).

Read-only: nothing under DIR is created, changed or removed. A path that leaves DIR (``..``, a link pointing out, a
hidden name) is refused (403), as is any file that is not a picture or a video (404). Bound to 127.0.0.1 unless
``--host`` says otherwise, which needs ``--token``: with a token every request carries it (``?token=``, the header
``X-Wanexp-Token`` or ``Authorization: Bearer``), else 401.
"""
from __future__ import annotations

import errno
import hmac
import ipaddress
import json
import math
import os
import re
import socket
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from urllib.parse import parse_qs, quote, unquote, urlsplit

from wanexp.cli.run_status import live_state, read_status, run_seconds
from wanexp.errors import ConfigError

MEDIA_TYPES = {".mp4": "video/mp4", ".webm": "video/webm", ".png": "image/png", ".jpg": "image/jpeg",
               ".jpeg": "image/jpeg", ".gif": "image/gif"}
MAX_DEPTH = 4  # how far below DIR runs and sweeps are looked for (outputs/sweeps/<name>/<point> is 3)
MAX_REJECTS = 200  # rejects listed per run (the counts are all of them)
VIDEO = re.compile(r"p(?P<prompt>\d+)_s(?P<seed>-?\d+)(?:_(?P<shape>\d+x\d+x\d+))?(?P<base>_base)?\.mp4")


# ---- what is under DIR -----------------------------------------------------------------------------------------
def _natural(text: str) -> list:
    """Sort key: numbers inside a name compare as numbers (sweep points 2 before 10)."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", text) if t]


def discover(root: Path) -> dict[str, tuple[str, Path]]:
    """Every run (a folder holding status.json) and sweep (a folder holding multirun.yaml or points.jsonl) at or
    below ``root``: name -> (kind, folder). A name is the folder's path below ``root`` (``root``'s own name for
    ``root`` itself). A run's subfolders, hidden folders and links are not entered."""
    from wanexp.callbacks.sweep import RECORDS

    found: dict[str, tuple[str, Path]] = {}

    def visit(folder: Path, depth: int) -> None:
        name = folder.relative_to(root).as_posix() if folder != root else root.name
        if (folder / "status.json").is_file():
            found[name] = ("run", folder)
            return
        if (folder / "multirun.yaml").is_file() or (folder / RECORDS).is_file():
            found[name] = ("sweep", folder)
        if depth >= MAX_DEPTH:
            return
        try:
            children = [Path(e.path) for e in os.scandir(folder)
                        if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)]
        except OSError:
            return
        for child in sorted(children, key=lambda p: _natural(p.name)):
            visit(child, depth + 1)

    visit(root, 0)
    return found


def _sweep_of(folder: Path, entries: dict) -> str | None:
    """The sweep a run folder belongs to: the name of the nearest folder above it (up to the root) that is one."""
    sweeps = {path: name for name, (kind, path) in entries.items() if kind == "sweep"}
    return next((sweeps[p] for p in folder.parents if p in sweeps), None)


def _finite(obj):
    """``obj`` with every non-finite float as None (JSON has no NaN; the page's JSON.parse refuses it)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _read_lines(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line being appended right now
        if isinstance(entry, dict):
            out.append(entry)
    return out


class RunTree:
    """The runs and sweeps under one folder, read on request (nothing cached but the validation prompts per
    config.yaml version), never written."""

    def __init__(self, root: Path):
        self.root = Path(os.path.realpath(root))
        self._prompts: dict[Path, tuple[float, list[str]]] = {}

    def url(self, path: Path) -> str:
        """The /files/ URL of a file under the root."""
        return "/files/" + quote(path.relative_to(self.root).as_posix())

    # ---- /api/runs -----------------------------------------------------------------------------------------
    def runs(self) -> dict:
        entries = discover(self.root)
        now = time.time()
        runs, sweeps = [], []
        for name, (kind, folder) in entries.items():
            if kind == "sweep":
                sweeps.append({"name": name, "folder": str(folder)})
            else:
                runs.append({"name": name, "sweep": _sweep_of(folder, entries), **self._summary(folder, now)})
        return _finite({"root": str(self.root), "now": now, "runs": runs, "sweeps": sweeps})

    def _summary(self, folder: Path, now: float, status: dict | None = None) -> dict:
        s = read_status(folder) if status is None else status
        step, total = s.get("step"), s.get("total_steps")
        state = live_state(s, now)
        return {"run_name": s.get("run_name", folder.name), "state": state, "step": step, "total_steps": total,
                "progress": step / total if isinstance(step, (int, float)) and total else None,
                "eta_s": s.get("eta_s") if state == "running" else None, "elapsed_s": run_seconds(s),
                "loss": s.get("loss"), "val_loss": s.get("val_loss"), "lr": s.get("lr"),
                "world_size": s.get("world_size"), "updated": s.get("updated")}

    # ---- /api/runs/<name> ----------------------------------------------------------------------------------
    def detail(self, name: str) -> dict | None:
        """A run's or a sweep's page data; None for a name that is neither (a run is found among those under the
        root, never by joining the name to a path)."""
        entries = discover(self.root)
        if name not in entries:
            return None
        kind, folder = entries[name]
        data = self._sweep(folder, entries) if kind == "sweep" else self._run(folder)
        return _finite({"name": name, "kind": kind, "folder": str(folder), **data})

    def _run(self, folder: Path) -> dict:
        from wanexp.callbacks.loss_plot import run_history

        s = read_status(folder)
        keys = ("step", "loss", "lr", "val_loss", "samples_per_s")
        history = [{k: h.get(k) for k in keys} for h in run_history(folder)]
        pictures = [{"label": label, "url": self.url(p), "mtime": p.stat().st_mtime}
                    for label, p in (("validation strip (base, then LoRA)", folder / "validation" / "strip.png"),
                                     ("loss", folder / "loss.png")) if p.is_file()]
        return {**self._summary(folder, time.time(), s), "status": s, "history": history,
                "ranks": s.get("ranks") or [], "videos": self._videos(folder, s.get("step")), "pictures": pictures,
                "rejects": self._rejects(folder, s)}

    def _validation_prompts(self, folder: Path) -> list[str]:
        """callbacks.validation.prompts from the run's config.yaml (read again when the file changes)."""
        import yaml

        path = folder / "config.yaml"
        try:
            mtime = path.stat().st_mtime
        except OSError:
            return []
        cached = self._prompts.get(path)
        if cached and cached[0] == mtime:
            return cached[1]
        try:
            cfg = yaml.safe_load(path.read_text()) or {}
            prompts = [str(p) for p in ((cfg.get("callbacks") or {}).get("validation") or {}).get("prompts") or []]
        except (OSError, yaml.YAMLError, AttributeError):
            prompts = []
        self._prompts[path] = (mtime, prompts)
        return prompts

    def _videos(self, folder: Path, step: int | None) -> list[dict]:
        """The validation videos up to the run's ``step``, newest step first: step, prompt (by its index in the run's
        validation prompts), seed, shape, whether it is the base model's, URL. (A video of a later step is an earlier
        run's that this folder still holds: overwrite=true or a resume from an earlier checkpoint.)"""
        prompts = self._validation_prompts(folder)
        out = []
        for step_dir in (folder / "validation").glob("step_*"):
            if not step_dir.name[5:].isdigit() or step_dir.is_symlink() or \
                    isinstance(step, int) and int(step_dir.name[5:]) > step:
                continue
            for video in step_dir.iterdir():
                m = VIDEO.fullmatch(video.name)
                if not m or not video.is_file():
                    continue
                i = int(m["prompt"])
                out.append({"step": int(step_dir.name[5:]), "prompt_index": i,
                            "prompt": prompts[i] if i < len(prompts) else None, "seed": int(m["seed"]),
                            "shape": m["shape"], "base": bool(m["base"]), "url": self.url(video),
                            "mtime": video.stat().st_mtime})
        return sorted(out, key=lambda v: (-v["step"], v["prompt_index"], v["seed"], v["shape"] or "", v["base"]))

    def _rejects(self, folder: Path, s: dict) -> dict:
        """Rows left out before training (rejects.jsonl; its warnings apart) and samples that failed to decode during
        training (rejects-online-r*.jsonl), the first MAX_REJECTS listed."""
        before = [e for e in _read_lines(folder / "rejects.jsonl") if e.get("kind", "reject") == "reject"]
        during = [e for p in sorted(folder.glob("rejects-online-r*.jsonl")) for e in _read_lines(p)]
        items = [{"when": "before training", **e} for e in before] + [{"when": "during training", **e} for e in during]
        return {"before": (s.get("data") or {}).get("rejected", len(before)),
                "during": s.get("rejected_online", len(during)), "listed": items[:MAX_REJECTS], "total": len(items)}

    def _sweep(self, folder: Path, entries: dict) -> dict:
        from wanexp.callbacks.sweep import (METRIC_NAMES, _swept, point_values, rank_lr_grid, ranking_key,
                                            sweep_folder_keys, sweep_rows)

        rows = sweep_rows(folder)
        keys = _swept(rows, sweep_folder_keys(folder)) if rows else []
        runs = {path: name for name, (kind, path) in entries.items() if kind == "run"}
        table = []
        for row in rows:
            pairs = point_values(row)
            table.append({"point": row["point"], "values": {k: pairs.get(k) for k in keys}, "state": row["state"],
                          "reason": row["reason"], "step": row["step"], "total_steps": row["total_steps"],
                          "final_train_loss": row["final_train_loss"], "val_loss": row["val_loss"],
                          "samples_per_s": row["samples_per_s"], "elapsed_s": row["elapsed_s"],
                          "run": runs.get(Path(row["run_dir"])),
                          "curve": [[h["step"], h["loss"]] for h in row["history"] if h.get("loss") is not None]})
        rank_by = ranking_key(rows) if rows else "final_train_loss"
        pictures = [{"label": label, "url": self.url(folder / f), "mtime": (folder / f).stat().st_mtime}
                    for label, f in (("summary: loss per point", "loss.png"), ("summary: heatmap", "heatmap.png"))
                    if (folder / f).is_file()]
        return {"keys": keys, "metric": rank_by, "metric_name": METRIC_NAMES[rank_by], "points": table,
                "heatmap": rank_lr_grid(rows, keys, rank_by), "pictures": pictures}

    # ---- /files/<path> -------------------------------------------------------------------------------------
    def media(self, rel: str) -> tuple[int, Path | None]:
        """(HTTP status, file) for a /files/ path: 200 and the file, 403 for a path that leaves the root (``..``, an
        absolute path, a hidden name, a link out of it), 404 for anything else that is not a picture or video."""
        rel = unquote(rel)
        parts = PurePosixPath(rel).parts
        if not parts or "\x00" in rel or rel.startswith("/") or "\\" in rel or \
                any(p in ("..", ".") or p.startswith(".") for p in parts):
            return 403, None
        real = Path(os.path.realpath(self.root.joinpath(*parts)))
        if not real.is_relative_to(self.root):
            return 403, None
        if real.suffix.lower() not in MEDIA_TYPES or not real.is_file():
            return 404, None
        return 200, real


# ---- HTTP ------------------------------------------------------------------------------------------------------
class _Handler(BaseHTTPRequestHandler):
    server: "StatusServer"
    server_version = "wanexp-status"

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        pass  # no line per request

    def _authorized(self, query: dict) -> bool:
        token = self.server.token
        if not token:
            return True
        given = (query.get("token") or [""])[0] or self.headers.get("X-Wanexp-Token", "")
        auth = self.headers.get("Authorization", "")
        if not given and auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        return hmac.compare_digest(given.encode(), token.encode())

    def _send(self, status: int, body: bytes, content_type: str, extra: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, data) -> None:
        self._send(status, json.dumps(data).encode(), "application/json")

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urlsplit(self.path)
        path = url.path
        if not self._authorized(parse_qs(url.query)):
            self._json(401, {"error": "a token is required: open the page as /?token=TOKEN (or send the header "
                                      "X-Wanexp-Token)"})
            return
        tree = self.server.tree
        if path in ("/", "/index.html"):
            from wanexp.cli.status_page import PAGE

            csp = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
                   "img-src 'self'; media-src 'self'")
            self._send(200, PAGE.encode(), "text/html; charset=utf-8", {"Content-Security-Policy": csp})
        elif path == "/api/runs":
            self._json(200, {**tree.runs(), "every_s": self.server.every_s})
        elif path.startswith("/api/runs/"):
            detail = tree.detail(unquote(path[len("/api/runs/"):]))
            if detail is None:
                self._json(404, {"error": "no such run or sweep under the served folder"})
            else:
                self._json(200, detail)
        elif path.startswith("/files/"):
            status, file = tree.media(path[len("/files/"):])
            if file is None:
                self._json(status, {"error": "outside the served folder" if status == 403 else "no such picture or "
                                    "video under the served folder"})
            else:
                self._file(file)
        else:
            self._json(404, {"error": "no such page"})

    do_HEAD = do_GET  # noqa: N815

    def _refused(self) -> None:
        self._json(405, {"error": "read-only: GET and HEAD only"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refused  # noqa: N815

    def _file(self, file: Path) -> None:
        """A picture or video, whole or the byte range asked for (a video player seeks with Range requests)."""
        size = file.stat().st_size
        start, end, status = 0, size - 1, 200
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", "").strip())
        if m and (m[1] or m[2]):
            start, end = (int(m[1]), min(int(m[2]) if m[2] else size - 1, size - 1)) if m[1] else \
                (max(0, size - int(m[2])), size - 1)
            if start > end or start >= size:
                self._send(416, b"", "text/plain", {"Content-Range": f"bytes */{size}"})
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", MEDIA_TYPES[file.suffix.lower()])
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("X-Content-Type-Options", "nosniff")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if self.command == "HEAD":
            return
        with open(file, "rb") as f:
            f.seek(start)
            left = end - start + 1
            while left > 0:
                chunk = f.read(min(left, 1 << 16))
                if not chunk:
                    break
                self.wfile.write(chunk)
                left -= len(chunk)


class StatusServer(ThreadingHTTPServer):
    """The page's server: a thread per request over one :class:`RunTree`."""

    daemon_threads = True

    def __init__(self, folder: Path, host: str, port: int, token: str | None, every_s: float):
        self.tree = RunTree(folder)
        self.token = token or None
        self.every_s = float(every_s)
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), _Handler)

    def server_bind(self) -> None:
        import socketserver

        socketserver.TCPServer.server_bind(self)  # not HTTPServer's: it looks the host's name up (DNS)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def handle_error(self, request, client_address) -> None:
        import sys

        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return  # a video player dropping a range it no longer needs
        super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        host = self.server_name if ":" not in self.server_name else f"[{self.server_name}]"
        return f"http://{host}:{self.server_port}/" + (f"?token={quote(self.token)}" if self.token else "")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only (localhost, 127.0.0.0/8, ::1); a name other than localhost is not."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def make_server(folder: Path, host: str = "127.0.0.1", port: int = 8765, token: str | None = None,
                every_s: float = 2.0) -> StatusServer:
    """The server, bound and ready for ``serve_forever``; bad input (a folder that is not one, another address
    without a token, a port that is taken) is a ConfigError."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder}: no such folder; give a run folder (outputs/<run_name>), a sweep folder "
                          "(outputs/sweeps/<name>) or an outputs folder")
    if token is not None and not token.strip():
        raise ConfigError("--token is empty; give a secret string (e.g. from `openssl rand -hex 16`)")
    if not is_loopback(host) and not token:
        raise ConfigError(f"--host {host} serves the page beyond this machine: give --token TOKEN too (every "
                          "request then needs it), or leave --host out (127.0.0.1)")
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port}: give a port number from 1 to 65535 (0: any free port)")
    try:
        return StatusServer(folder, host, port, token, every_s)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            why = "is in use (another wanexp-status --serve?); give another --port, or 0 for any free one"
        elif e.errno == errno.EACCES:
            why = "needs privileges on this machine; give a port above 1023"
        elif isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
            why = f"cannot be bound: {host} is not an address of this machine"
        else:
            why = f"cannot be bound: {e.strerror or e}"
        raise ConfigError(f"--host {host} --port {port} {why}") from None


def serve(folder: Path, host: str, port: int, token: str | None, every_s: float) -> int:
    """``wanexp-status DIR --serve``: serve until Ctrl-C (or SIGTERM), then exit 0."""
    import signal
    import threading

    server = make_server(folder, host, port, token, every_s)
    runs = discover(server.tree.root)
    n_runs = sum(kind == "run" for kind, _ in runs.values())
    print(f"wanexp-status: serving {server.tree.root} ({n_runs} run(s) now, new ones appear as they start) at "
          f"{server.url}  (Ctrl-C stops)", flush=True)

    def stop(signum, frame) -> None:  # Ctrl-C and SIGTERM alike: the loop ends at its next poll, never mid-request
        threading.Thread(target=server.shutdown, daemon=True).start()

    # our own handler for both (also where the launcher left SIGINT ignored, as a background job's is)
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        server.server_close()
    print("wanexp-status: stopped", flush=True)
    return 0
