"""The live run page's server (``wanexp-status DIR --serve``) over folders written the way the callbacks write them:
its JSON API, its media route's limits (read-only, nothing outside the folder), the token, the command's refusals
and its stop. The page itself in a browser: tests/integration/test_status_page.py."""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.unit.test_status_cli import _point, _run
from wanexp.callbacks.sweep import record_point
from wanexp.cli import status as status_cli
from wanexp.cli.status_server import StatusServer, make_server

PROMPTS = ["a red fox runs through fresh snow", "waves roll onto a sandy beach"]


def _videos(run: Path, steps: dict[int, bool]) -> None:
    """validation/step_NNNNNN/p<i>_s0[_base].mp4 for both prompts, and the run's config.yaml naming them."""
    (run / "config.yaml").write_text(json.dumps({"callbacks": {"validation": {"prompts": PROMPTS}},
                                                 "overrides": ["experiment=demo"]}))  # JSON is YAML
    for step, base in steps.items():
        folder = run / "validation" / f"step_{step:06d}"
        folder.mkdir(parents=True)
        for i in range(len(PROMPTS)):
            (folder / f"p{i}_s0{'_base' if base else ''}.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(64))
        (folder / "metrics.json").write_text("{}")
    (run / "validation" / "strip.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8)


@pytest.fixture
def outputs(tmp_path) -> Path:
    """An outputs folder: a live run with validation, rejects and two ranks; a failed one; a 2 x 2 rank x lr sweep."""
    out = tmp_path / "outputs"
    ranks = [{"rank": r, "step": 40, "loss": 0.5 + r, "samples_per_s": 3.0, "mem_gib": 12.5 + r,
              "peak_mem_gib": 14.0, "gpu_util": 90.0 + r, "rejected_online": r} for r in range(2)]
    live = _run(out / "live", state="running", step=42, total_steps=100, eta_s=125.0, elapsed_total_s=61.0,
                elapsed_s=61.0, loss=0.4321, lr=1e-4, val_loss=0.61, pid=os.getpid(), host=socket.gethostname(),
                world_size=2, mem_gib=12.5, gpu_util=90.0, ranks=ranks, data={"rejected": 1}, rejected_online=1)
    with open(live / "status.jsonl", "w") as f:
        for step in (10, 20, 30, 40):
            f.write(json.dumps({"step": step, "time": 0, "loss": 1.0 / step, "lr": step / 1e6,
                                "samples_per_s": 3.0}) + "\n")
        f.write(json.dumps({"step": 40, "time": 0, "val": {"loss": 0.61}, "val_loss": 0.61}) + "\n")
        f.write('{"step": 50, "lo')  # a line being appended right now
    _videos(live, {0: True, 40: False, 90: False})  # step 90: left by an earlier run of the folder (overwrite=true)
    (live / "rejects.jsonl").write_text(
        json.dumps({"kind": "reject", "source": "clips/bad.mp4", "path": "clips/bad.mp4", "reason": "no video"}) +
        "\n" + json.dumps({"kind": "warning", "source": "clips/long.mp4", "path": "x", "reason": "long caption"}) +
        "\n")
    (live / "rejects-online-r001.jsonl").write_text(json.dumps(
        {"kind": "reject", "source": "clips/torn.mp4", "path": "clips/torn.mp4", "reason": "decode error",
         "step": 33}) + "\n")
    _run(out / "broken", state="failed", step=3, total_steps=100, eta_s=300.0, error="DivergedError: loss is nan")
    sweep = out / "sweeps" / "rank_lr"
    for n, (rank, lr, losses) in enumerate([(8, "1e-4", [3, 2]), (8, "1e-3", [2, 1]), (16, "1e-4", [4, 3]),
                                            (16, "1e-3", [5, 4])]):
        _point(sweep / str(n), rank, lr, losses)
        record_point(sweep, str(n), [f"adapter.rank={rank}", f"optim.lr={lr}"], "finished", None)
    (out / "cache").mkdir()  # not a run: not listed
    return out


@contextlib.contextmanager
def serving(folder: Path, **kwargs):
    """The server on a free port of 127.0.0.1, in a thread; yields its base URL's (host, port)."""
    server = make_server(folder, port=0, **kwargs)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def get(server, path: str, headers: dict | None = None, method: str = "GET") -> tuple[int, dict, bytes]:
    """One request with ``path`` sent as it is (no client-side normalisation of ``..``)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.server_port, timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def api(server, path: str):
    status, _, body = get(server, path)
    assert status == 200, body
    return json.loads(body)


def test_api_runs_lists_every_run_and_sweep_of_an_outputs_folder(outputs):
    with serving(outputs) as server:
        data = api(server, "/api/runs")
    runs = {r["name"]: r for r in data["runs"]}
    assert list(runs) == ["broken", "live", "sweeps/rank_lr/0", "sweeps/rank_lr/1", "sweeps/rank_lr/2",
                          "sweeps/rank_lr/3"]
    assert [s["name"] for s in data["sweeps"]] == ["sweeps/rank_lr"]
    live = runs["live"]
    assert (live["state"], live["step"], live["total_steps"], live["progress"]) == ("running", 42, 100, 0.42)
    assert (live["eta_s"], live["elapsed_s"], live["loss"], live["val_loss"], live["lr"]) == (125.0, 61.0, 0.4321,
                                                                                             0.61, 1e-4)
    assert live["sweep"] is None and runs["sweeps/rank_lr/2"]["sweep"] == "sweeps/rank_lr"
    assert runs["broken"]["state"] == "failed" and runs["broken"]["eta_s"] is None  # no ETA for a run that stopped


def test_api_run_detail_has_its_history_gpus_videos_and_rejects(outputs):
    with serving(outputs) as server:
        d = api(server, "/api/runs/live")
    assert d["kind"] == "run" and d["status"] == json.loads((outputs / "live" / "status.json").read_text())
    assert d["history"] == [  # a step's training and validation lines merged; the line being written left out
        {"step": step, "loss": 1.0 / step, "lr": step / 1e6, "val_loss": 0.61 if step == 40 else None,
         "samples_per_s": 3.0} for step in (10, 20, 30, 40)]
    assert [(r["rank"], r["mem_gib"], r["gpu_util"]) for r in d["ranks"]] == [(0, 12.5, 90.0), (1, 13.5, 91.0)]
    assert [(v["step"], v["prompt"], v["base"], v["url"]) for v in d["videos"]] == [
        (40, PROMPTS[0], False, "/files/live/validation/step_000040/p0_s0.mp4"),
        (40, PROMPTS[1], False, "/files/live/validation/step_000040/p1_s0.mp4"),
        (0, PROMPTS[0], True, "/files/live/validation/step_000000/p0_s0_base.mp4"),
        (0, PROMPTS[1], True, "/files/live/validation/step_000000/p1_s0_base.mp4")]
    assert [p["url"] for p in d["pictures"]] == ["/files/live/validation/strip.png"]
    r = d["rejects"]
    assert (r["before"], r["during"], r["total"]) == (1, 1, 2)  # the warning is no reject
    assert [(e["when"], e["source"], e["reason"]) for e in r["listed"]] == [
        ("before training", "clips/bad.mp4", "no video"), ("during training", "clips/torn.mp4", "decode error")]


def test_api_sweep_detail_is_its_table_and_rank_by_lr_grid(outputs):
    with serving(outputs) as server:
        d = api(server, "/api/runs/sweeps%2Frank_lr")
        assert get(server, "/api/runs/sweeps/nope")[0] == 404
    assert d["kind"] == "sweep" and d["keys"] == ["adapter.rank", "optim.lr"] and d["metric"] == "final_train_loss"
    assert [(p["point"], p["values"], p["final_train_loss"], p["run"]) for p in d["points"]] == [
        ("0", {"adapter.rank": "8", "optim.lr": "1e-4"}, 2.5, "sweeps/rank_lr/0"),
        ("1", {"adapter.rank": "8", "optim.lr": "1e-3"}, 1.5, "sweeps/rank_lr/1"),
        ("2", {"adapter.rank": "16", "optim.lr": "1e-4"}, 3.5, "sweeps/rank_lr/2"),
        ("3", {"adapter.rank": "16", "optim.lr": "1e-3"}, 4.5, "sweeps/rank_lr/3")]
    assert d["points"][1]["curve"] == [[1, 2], [2, 1]]
    assert d["heatmap"] == {"rank_key": "adapter.rank", "lr_key": "optim.lr", "ranks": ["8", "16"],
                            "lrs": ["1e-4", "1e-3"], "values": [[2.5, 1.5], [3.5, 4.5]]}


def test_a_run_folder_or_a_sweep_folder_is_served_on_its_own(outputs):
    with serving(outputs / "live") as server:
        assert [r["name"] for r in api(server, "/api/runs")["runs"]] == ["live"]
        assert api(server, "/api/runs/live")["videos"][0]["url"] == "/files/validation/step_000040/p0_s0.mp4"
    with serving(outputs / "sweeps" / "rank_lr") as server:
        data = api(server, "/api/runs")
        assert [r["name"] for r in data["runs"]] == ["0", "1", "2", "3"]
        assert [s["name"] for s in data["sweeps"]] == ["rank_lr"]
        assert {r["sweep"] for r in data["runs"]} == {"rank_lr"}


def _tree(folder: Path) -> dict:
    """Every path under ``folder`` with its size and modification time (folders included)."""
    return {str(p): (p.stat().st_size if p.is_file() else None, p.stat().st_mtime_ns)
            for p in [folder, *folder.rglob("*")]}


def test_media_are_read_only_and_nothing_outside_the_folder_is_reachable(outputs, tmp_path):
    (tmp_path / "secret.png").write_bytes(b"\x89PNG secret")
    (outputs / "live" / "validation" / "escape.png").symlink_to(tmp_path / "secret.png")  # a link pointing out
    (outputs / "live" / "validation" / "inside.png").symlink_to(outputs / "live" / "validation" / "strip.png")
    before = _tree(outputs)
    strip = (outputs / "live" / "validation" / "strip.png").read_bytes()
    with serving(outputs) as server:
        status, headers, body = get(server, "/files/live/validation/strip.png")
        assert (status, headers["Content-Type"], body) == (200, "image/png", strip)
        status, headers, body = get(server, "/files/live/validation/strip.png", {"Range": "bytes=100-199"})
        assert (status, headers["Content-Range"], body) == (206, f"bytes 100-199/{len(strip)}", strip[100:200])
        assert get(server, "/files/live/validation/inside.png")[2] == strip  # a link inside the folder is fine
        assert get(server, "/files/live/validation/step_000040/p0_s0.mp4")[1]["Content-Type"] == "video/mp4"
        refused = {path: get(server, path)[0] for path in (
            "/files/../secret.png", "/files/live/../../secret.png", "/files/%2e%2e/secret.png",
            "/files/live%2F..%2F..%2Fsecret.png", "/files//" + str(tmp_path / "secret.png"),
            "/files/live/validation/escape.png", "/files/live/.lock", "/files/live/status.json",
            "/files/live/config.yaml", "/files/live/validation/nope.png", "/files/live/validation")}
        assert refused == {
            "/files/../secret.png": 403, "/files/live/../../secret.png": 403, "/files/%2e%2e/secret.png": 403,
            "/files/live%2F..%2F..%2Fsecret.png": 403, "/files//" + str(tmp_path / "secret.png"): 403,
            "/files/live/validation/escape.png": 403, "/files/live/.lock": 403,
            "/files/live/status.json": 404, "/files/live/config.yaml": 404,  # not a picture or video
            "/files/live/validation/nope.png": 404, "/files/live/validation": 404}
        for method in ("POST", "PUT", "DELETE"):
            assert get(server, "/api/runs/live", method=method)[0] == 405
        for path in ("/", "/api/runs", "/api/runs/live", "/api/runs/sweeps%2Frank_lr"):
            assert get(server, path)[0] == 200
    assert _tree(outputs) == before  # nothing created, changed or removed


def test_the_page_is_self_contained():
    """No script, style or font from elsewhere (the machines are often offline): the one absolute URL is SVG's
    namespace."""
    from wanexp.cli.status_page import PAGE

    assert re.findall(r"(?:https?:)?//[\w.-]+\.\w+[^\s\"'`)]*", PAGE) == ["http://www.w3.org/2000/svg"]
    assert not re.search(r"<(?:script|link|img|iframe)[^>]*\s(?:src|href)=", PAGE)


def test_with_a_token_every_request_needs_it(outputs):
    with serving(outputs, token="s3cret") as server:
        for path in ("/", "/api/runs", "/api/runs/live", "/files/live/validation/strip.png"):
            assert get(server, path)[0] == 401
            assert get(server, path + "?token=wrong")[0] == 401
            assert get(server, path + "?token=s3cret")[0] == 200
            assert get(server, path, {"X-Wanexp-Token": "s3cret"})[0] == 200
            assert get(server, path, {"Authorization": "Bearer s3cret"})[0] == 200
        assert server.url.endswith("/?token=s3cret")


def test_refusals_are_one_line_exit_2(outputs, tmp_path, capsys, monkeypatch):
    def served(self, **kwargs):
        raise AssertionError("served where it must refuse")  # instead of serving until Ctrl-C

    monkeypatch.setattr(StatusServer, "serve_forever", served)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        cases = [[str(tmp_path / "nope"), "--serve"], [str(outputs / "live" / "status.json"), "--serve"],
                 [str(outputs), "--serve", "--host", "0.0.0.0"], [str(outputs), "--serve", "--host", "example.org"],
                 [str(outputs), "--serve", "--host", "0.0.0.0", "--token", " "],
                 [str(outputs), "--serve", "--port", str(taken.getsockname()[1])],
                 [str(outputs), "--serve", "--port", "70000"], [str(outputs), "--serve", "--follow"],
                 [str(outputs / "live"), "--port", "8000"]]
        codes = [status_cli.main(args) for args in cases]
    finally:
        taken.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert codes == [2] * len(cases) and len(err) == len(cases), err
    assert all(line.startswith("wanexp: error: ") for line in err)
    assert "no such folder" in err[0] and "no such folder" in err[1]
    assert "--token" in err[2] and "--token" in err[3] and "empty" in err[4]
    assert "in use" in err[5] and "another --port" in err[5]
    assert "70000" in err[6] and "give one" in err[7] and "--serve" in err[8]


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_the_command_serves_until_ctrl_c_and_stops_cleanly(outputs, sigint):
    """Ctrl-C stops the server at its next poll, with SIGINT as Python sets it up and where the launcher left it
    ignored (a background job: Python then raises no KeyboardInterrupt)."""
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint == "ignored" else None
    proc = subprocess.Popen([sys.executable, "-m", "wanexp.cli.status", str(outputs), "--serve", "--port", "0"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ignore)
    try:
        line = proc.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert url and "6 run(s)" in line, line
        conn = http.client.HTTPConnection("127.0.0.1", int(url[1]), timeout=10)
        conn.request("GET", "/api/runs")
        assert len(json.loads(conn.getresponse().read())["runs"]) == 6
        conn.close()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert (proc.returncode, err, out.strip()) == (0, "", "wanexp-status: stopped")
    with pytest.raises(OSError):  # the port is free again: nothing listens
        socket.create_connection(("127.0.0.1", int(url[1])), timeout=2).close()
