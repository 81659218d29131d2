"""The sweep summary: every point of the grid with its state and reason, the heatmap's layout, the sweeps page."""
from __future__ import annotations

import pytest

from wanexp.callbacks.sweep import TRAIN_LOSS, VAL_LOSS


@pytest.mark.parametrize("ranks,lrs", [(["4"], ["0.0001"]), (["4", "8"], ["0.0001", "0.001"]),
                                       (["8", "16", "32", "64"], ["5e-05", "0.0001", "0.0002"])])
@pytest.mark.parametrize("metric", [TRAIN_LOSS, VAL_LOSS])
def test_the_heatmap_shows_its_colour_bar_label_whole(ranks, lrs, metric):
    """Every text of the heatmap (the colour bar's label naming the loss and "lower is better", the title, the
    ticks and the cells) lies inside the saved figure, for a one-cell grid too."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from wanexp.callbacks.sweep import heatmap_figure

    z = np.arange(len(ranks) * len(lrs), dtype=float).reshape(len(ranks), len(lrs)) + 0.123
    fig = heatmap_figure(z, ranks, lrs, "adapter.rank", "optim.lr", "rank_lr", metric)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    bar = fig.axes[1].yaxis.label
    assert " ".join(bar.get_text().split()) == f"{metric}, lower is better"
    texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text().strip()]
    outside = [t.get_text() for t in texts if not fig.bbox.contains(*t.get_window_extent(renderer).min)
               or not fig.bbox.contains(*t.get_window_extent(renderer).max)]
    plt.close(fig)
    assert not outside, outside


def _job(sweep_dir, n: int, task: list[str]):
    """The config Hydra hands on_job_end for point n of a multirun."""
    from omegaconf import OmegaConf

    return OmegaConf.create({"hydra": {"mode": "RunMode.MULTIRUN", "runtime": {"output_dir": str(sweep_dir / str(n))},
                                       "overrides": {"task": task}}})


def _stopped(state: str, line: str, code: int = 2):
    from types import SimpleNamespace

    from wanexp.callbacks.sweep import PointStopped

    return SimpleNamespace(status=SimpleNamespace(name="FAILED"), _return_value=PointStopped(state, line, code))


def test_the_summary_lists_every_point_of_the_grid_with_its_state_and_reason(tmp_path, capsys):
    """A 2x2 grid: point 0 finished, 1 refused (its folder held by another run, whose status says running), 2 failed
    once started, 3 not run yet: four rows, each with its state; the reasons in the CSV and under the table."""
    import csv
    import json
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from wanexp.callbacks.sweep import SweepSummary, write_summary
    from wanexp.config import compose

    cfg = compose([f"paths.root_dir={tmp_path}"], return_hydra_config=True)
    cfg.hydra.overrides.task = ["experiment=demo", "adapter.rank=4,8", "optim.lr=1e-4,1e-3"]
    sweep_dir = tmp_path / "s"
    sweep_dir.mkdir()
    OmegaConf.save(cfg, sweep_dir / "multirun.yaml")  # as the sweeper writes it before the first point
    points = [["adapter.rank=4", "optim.lr=0.0001"], ["adapter.rank=4", "optim.lr=0.001"],
              ["adapter.rank=8", "optim.lr=0.0001"]]
    for n, state in ((0, "finished"), (1, "running"), (2, "failed")):
        (sweep_dir / str(n)).mkdir()
        (sweep_dir / str(n) / "status.json").write_text(json.dumps({"state": state, "step": 3, "error": "boom"}))
        (sweep_dir / str(n) / "status.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
    cb = SweepSummary()
    cb.sweep_dir = sweep_dir
    cb.on_job_end(_job(sweep_dir, 0, ["experiment=demo", *points[0]]),
                  SimpleNamespace(status=SimpleNamespace(name="COMPLETED"), return_value=None))
    cb.on_job_end(_job(sweep_dir, 1, ["experiment=demo", *points[1]]),
                  _stopped("refused", "paths.output_dir=X is in use by a live run (pid 1 on h, started t); wait"))
    cb.on_job_end(_job(sweep_dir, 2, ["experiment=demo", *points[2]]),
                  _stopped("failed", "disk full while saving checkpoint C: free space on /"))
    printed = capsys.readouterr().out
    assert "wanexp: sweep: point 1 refused: paths.output_dir=X is in use by a live run" in printed
    assert "wanexp: sweep: point 2 failed at step 3" in printed
    rows = list(csv.DictReader(write_summary(sweep_dir)["csv"].open()))
    assert [(r["point"], r["adapter.rank"], r["optim.lr"], r["state"]) for r in rows] == [
        ("0", "4", "0.0001", "finished"), ("1", "4", "0.001", "refused"), ("2", "8", "0.0001", "failed"),
        ("3", "8", "0.001", "not started")]
    assert [r["reason"] for r in rows] == ["", "paths.output_dir=X is in use by a live run (pid 1 on h, started t); "
                                           "wait", "disk full while saving checkpoint C: free space on /", ""]
    assert rows[1]["step"] == "" and rows[1]["final_train_loss"] == ""  # not the live run's numbers
    md = (sweep_dir / "summary.md").read_text()
    assert md.startswith("# Sweep s: 4 points (1 failed, 1 finished, 1 not started, 1 refused)")
    assert "- 1 (rank=4 lr=0.001): refused: paths.output_dir=X is in use" in md
    assert "- 2 (rank=8 lr=0.0001): failed: disk full while saving checkpoint C" in md


def test_a_sweep_whose_points_were_all_refused_puts_back_its_records_and_summary(tmp_path):
    """Every point refused: the sweep folder's own files (multirun.yaml, points.jsonl, the summary) as they were."""
    from wanexp.callbacks.sweep import SweepSummary, _snapshot

    sweep_dir = tmp_path / "s"
    sweep_dir.mkdir()
    for name in ("multirun.yaml", "points.jsonl", "summary.md"):
        (sweep_dir / name).write_text(f"old {name}\n")
    cb = SweepSummary()
    cb.sweep_dir, cb._keep = sweep_dir, _snapshot(sweep_dir)
    (sweep_dir / "multirun.yaml").write_text("new\n")
    cb.on_job_end(_job(sweep_dir, 0, ["adapter.rank=4"]), _stopped("refused", "a reason"))
    cb._summarize()
    assert {p.name: p.read_text() for p in sweep_dir.iterdir()} == {
        name: f"old {name}\n" for name in ("multirun.yaml", "points.jsonl", "summary.md")}
