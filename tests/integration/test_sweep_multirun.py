"""A plain Hydra multirun (``-m key=a,b``, no sweep config): the points run, the summary lists them; the same sweep
run again into its folder is refused before it writes anything."""
from __future__ import annotations

import csv
import re

import pytest

from tests.integration.test_cli_runs import _main, _main_ends

pytestmark = pytest.mark.slow


def test_plain_multirun_grid_then_a_refused_rerun_writes_nothing(shared_dir, tmp_path, monkeypatch, capsys):
    args = ["-m", "experiment=demo", f"paths.tiny_model_dir={shared_dir}/models", f"paths.data_dir={shared_dir}/data",
            f"paths.root_dir={tmp_path}", "trainer.max_steps=2", "trainer.log_every_n_steps=1",
            "callbacks.progress=null", "callbacks.validation=null", "callbacks.checkpoint.every_n_train_steps=2",
            "adapter.rank=4,8"]
    # the grid through the CLI's entry in this process (Hydra runs a multirun's points in the process that starts it)
    stdout = _main_ends(monkeypatch, capsys, args, stream="out")
    assert re.findall(r"wanexp: sweep:\s+(\d+): (.+)", stdout) == [("0", "adapter.rank=4"), ("1", "adapter.rank=8")]
    # each point's line names its loss (no validation data here: the train loss over the last logged steps)
    named = r"point \d finished at step 2: train loss \(mean of last 5 logged steps\) \d"
    assert len(re.findall(named, stdout)) == 2
    sweep_dir = tmp_path / "outputs" / "sweeps" / "multirun"
    assert "finished multirun/0_adapter.rank=4 at step 2" in stdout  # named after the swept key only
    rows = list(csv.DictReader((sweep_dir / "summary.csv").open()))
    assert [(r["point"], r["adapter.rank"], r["state"]) for r in rows] == [("0", "4", "finished"),
                                                                          ("1", "8", "finished")]
    assert "experiment" not in rows[0] and all(float(r["final_train_loss"]) > 0 for r in rows)
    md = (sweep_dir / "summary.md").read_text()
    assert "Ranked by train loss (mean of last 5 logged steps), lower is better" in md
    assert len([ln for ln in md.splitlines() if "| finished |" in ln or "**finished**" in ln]) == 2
    assert (sweep_dir / "loss.png").read_bytes()[:4] == b"\x89PNG"

    kept = ["multirun.yaml", "points.jsonl", "summary.csv", "summary.md", "loss.png", "0/config.yaml",
            "1/status.json"]
    before = {f: ((sweep_dir / f).read_bytes(), (sweep_dir / f).stat().st_mtime_ns) for f in kept}
    # another command line (multirun.yaml would differ); overwrite=false: the demo experiment sets it true
    # refused before any point starts
    code, err = _main(monkeypatch, capsys, [*args, "optim.lr=1e-3", "overwrite=false"])
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("wanexp: error: hydra.sweep.dir=")
    assert "points 0, 1 already hold" in err[0]
    assert "resume=last" in err[0] and "overwrite=true" in err[0]
    assert {f: ((sweep_dir / f).read_bytes(), (sweep_dir / f).stat().st_mtime_ns) for f in kept} == before


def test_a_refused_point_does_not_stop_the_sweep_and_the_summary_lists_every_point(shared_dir, tmp_path,
                                                                                   monkeypatch, capsys):
    """A 2x2 grid whose point 1 is held by a live run (its folder locked): point 1 is refused with one line, writes
    nothing into that run's folder (no .hydra/ either), and points 2 and 3 still run; summary.csv/.md and
    wanexp-status list the 4 points with their states and point 1's reason; the sweep exits 2."""
    import json

    from wanexp.cli import status as status_cli
    from wanexp.runfolder import RunLock

    sweep_dir = tmp_path / "outputs" / "sweeps" / "multirun"
    live = sweep_dir / "1"
    live.mkdir(parents=True)
    (live / "status.json").write_text(json.dumps({"state": "running", "step": 7, "run_name": "another command"}))
    lock = RunLock(live, 600)
    lock.acquire()  # a live run of another command holds the folder (this process: its OS lock is held)
    try:
        before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in live.iterdir()}
        code, err = _main(monkeypatch, capsys, [
            "-m", "experiment=demo", f"paths.tiny_model_dir={shared_dir}/models",
            f"paths.data_dir={shared_dir}/data", f"paths.root_dir={tmp_path}", "trainer.max_steps=1",
            "callbacks.progress=null", "callbacks.validation=null", "adapter.rank=4,8", "optim.lr=1e-4,1e-3"])
        after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in live.iterdir()}
    finally:
        lock.release()
    assert code == 2, err
    errors = [line for line in err if line.startswith("wanexp: error:")]
    assert len(errors) == 1 and "is in use by a live run" in errors[0], err
    assert after == before  # the live run's folder: nothing added (no .hydra/), nothing rewritten
    rows = list(csv.DictReader((sweep_dir / "summary.csv").open()))
    assert [(r["point"], r["adapter.rank"], r["optim.lr"], r["state"]) for r in rows] == [
        ("0", "4", "0.0001", "finished"), ("1", "4", "0.001", "refused"), ("2", "8", "0.0001", "finished"),
        ("3", "8", "0.001", "finished")]
    assert "is in use by a live run" in rows[1]["reason"] and rows[1]["step"] == "" and rows[0]["reason"] == ""
    md = (sweep_dir / "summary.md").read_text()
    assert "4 points (3 finished, 1 refused)" in md
    assert "- 1 (rank=4 lr=0.001): refused: paths.output_dir=" in md
    assert not list(sweep_dir.glob("*/.hydra"))
    assert status_cli.main([str(sweep_dir)]) == 0
    shown = capsys.readouterr().out
    assert "4 points (3 finished, 1 refused)" in shown and "is in use by a live run" in shown, shown
