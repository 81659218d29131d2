"""The CLI as users run it: 2-process DDP on CPU (gloo) with W&B offline, a multirun sweep, a resume, torchrun."""
from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

pytestmark = pytest.mark.slow


def _common(shared_dir, tmp_path) -> list[str]:
    return [
        "experiment=demo",
        f"paths.tiny_model_dir={shared_dir}/models",
        "trainer.log_every_n_steps=1",
    ]


WANDB_OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}  # as a user without a W&B login would run


def _wandb_env(tmp_path) -> dict:
    """W&B offline through the environment (the config leaves mode null); its own files under tmp_path."""
    return dict(WANDB_OFFLINE, WANDB_DATA_DIR=str(tmp_path / "wandb-data"), WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
                WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"))


@contextlib.contextmanager
def _wandb_offline(monkeypatch, tmp_path):
    """W&B offline (``_wandb_env``) for runs in this process: W&B reads its environment when it first sets up in a
    process, so it is set up anew for this test and torn down after it (nothing of it is left to a later test)."""
    import wandb

    for k, v in _wandb_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    wandb.teardown()
    try:
        yield
    finally:
        wandb.teardown()


def _bars(text: str) -> list[tuple[str, str]]:
    """(n, total) of every drawn state of the training bar."""
    return re.findall(r"Training:\s+\d+%\|[^|]*\| (\d+)/(\S+) ", text.replace("\r", "\n"))


def test_ddp_two_processes_with_wandb_offline_progress_and_status(shared_dir, tmp_path):
    """2 ranks (gloo), W&B offline via WANDB_MODE: the whole-run bar counts optimizer steps, status.json is written
    during the run with per-rank fields, and the offline W&B run holds the config, the metrics and the LoRA files."""
    import os
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT
    from tests.wandb_offline import summary

    # 16 clips, 2 ranks x batch 2, accumulation 2: 16 / (2 x 2) / 2 = 2 optimizer steps per epoch, x 3 epochs
    out = tmp_path / "ddp"
    args = [*_common(shared_dir, tmp_path), "parallel=ddp", "trainer.accelerator=cpu", "trainer.devices=2",
            f"paths.data_dir={tmp_path}/data", "data.generate.num_videos=16", "data.generate.num_images=0",
            "data.batch_size=2", "trainer.accumulate_grad_batches=2", "trainer.max_steps=-1", "trainer.max_epochs=3",
            "callbacks.checkpoint.every_n_train_steps=2", f"paths.output_dir={out}", "logger=[csv,wandb]",
            # validation videos: rank 0 samples while rank 1 waits; one prompt, two steps
            "callbacks.validation.every_n_steps=3", "callbacks.validation.prompts=[a red ball rolls]",
            "callbacks.validation.seeds=[0]", "callbacks.validation.steps=2"]
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", **_wandb_env(tmp_path)))
    during = None
    deadline = time.time() + 600
    while proc.poll() is None and time.time() < deadline:
        try:
            s = json.loads((out / "status.json").read_text())
        except (OSError, ValueError):
            s = {}
        if during is None and s.get("state") == "running" and s.get("step", 0) >= 1:
            during = s
        time.sleep(0.1)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    # during the run: step of total, ETA, per-rank fields of both ranks
    assert during is not None, "status.json never showed the running run"
    assert during["total_steps"] == 6 and during["eta_s"] is not None and during["eta_s"] >= 0
    assert [r["rank"] for r in during["ranks"]] == [0, 1] and all(r["loss"] is not None for r in during["ranks"])
    # after: the totals
    status = json.loads((out / "status.json").read_text())
    assert status["world_size"] == 2 and status["batches_per_epoch"] == 4 and status["steps_per_epoch"] == 2
    assert status["step"] == status["total_steps"] == 6 and status["state"] == "finished" and status["eta_s"] == 0
    assert status["replicas_in_sync"] is True  # gradients were all-reduced: both ranks hold the same LoRA
    assert [r["step"] for r in status["ranks"]] == [6, 6] and status["last_checkpoint"].endswith("step_000006.ckpt")
    history = [json.loads(x) for x in (out / "status.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5, 6] and all(h["loss"] > 0 for h in history)
    # one bar over the run's optimizer steps (rank 0 only), no per-epoch bars, no "Training: 0/?"
    text = stdout + stderr
    bars = _bars(text)
    assert bars and {t for _, t in bars} == {"6"} and bars[-1][0] == "6", text[-2000:]
    assert "Epoch " not in text and "0/?" not in text and "Tip:" not in text
    printed = re.findall(r"wanexp: LoRA file (\S+)", stdout)
    assert len(printed) == 2 and all(Path(p).is_file() for p in printed)  # printed once, by rank 0
    assert (out / "checkpoints" / "step_000002.ckpt").is_file() and (out / "lora" / "step_000004").is_dir()
    # W&B: one offline run (rank 0) in the run folder, with the config, the overrides, the metrics, the LoRA files
    (run,) = (out / "wandb").glob("offline-run-*")
    wb = summary(run)
    assert wb["config"]["adapter"]["rank"] == 8 and "logger=[csv,wandb]" in wb["config"]["overrides"]
    assert {"train/loss", "train/lr", "train/grad_norm", "train/skipped_steps", "perf/samples_per_s",
            "perf/tokens_per_s", "perf/tflops", "data/rejected", "data/rejected_online"} <= wb["metrics"]
    loras = [a for a in wb["artifacts"] if a[0] == "lora"]
    assert [a[1] for a in loras] == ["demo-lora"] * 3 and [sorted(a[3]) for a in loras] == \
        [["latest", "step-2"], ["latest", "step-4"], ["latest", "step-6"]]
    assert all(a[2] == ["tiny_lora_comfyui.safetensors", "tiny_lora_diffusers.safetensors"] for a in loras)
    assert not any(a[0] == "model" for a in wb["artifacts"]) and wb["exit_code"] == 0  # no .ckpt uploads
    # validation videos: the base model at step 0, the LoRA at step 3 and the end; they decode; W&B has them
    import av

    videos = sorted(p.relative_to(out / "validation").as_posix() for p in (out / "validation").rglob("*.mp4"))
    assert videos == ["step_000000/p0_s0_base.mp4", "step_000003/p0_s0.mp4", "step_000006/p0_s0.mp4"]
    for v in videos:
        with av.open(str(out / "validation" / v)) as c:
            assert sum(1 for _ in c.decode(video=0)) == 9  # data.num_frames of the demo
    assert {"val/base/p0_s0/_type", "val/video/p0_s0/_type"} <= wb["metrics"]  # a logged media file (wandb.Video)
    # the status command reads it (the per-rank table included)
    from wanexp.cli.status import render

    table, running = render(out)
    assert not running and "6 / 6 (100.0 %)" in table and "per rank" in table


def test_rank_lr_sweep_runs_every_point_in_its_own_folder(shared_dir, tmp_path, monkeypatch, capsys):
    """A 2x2 multirun: the job list first, one run folder and one W&B run per point in one group, alpha tied to rank,
    and at the end a 4-row summary (CSV + Markdown) and the plots in the sweep folder. Through the CLI's entry in
    this process (Hydra's multirun runs its points in the process that starts it, as from the command line)."""
    import csv

    from tests.wandb_offline import summary

    with _wandb_offline(monkeypatch, tmp_path):
        stdout = _main_ends(monkeypatch, capsys, [
            "-m", "sweep=rank_lr", *_common(shared_dir, tmp_path), f"paths.data_dir={shared_dir}/data",
            f"paths.root_dir={tmp_path}", "trainer.max_steps=2", "callbacks.progress=null", "logger=wandb",
            "adapter.rank=4,8", "optim.lr=1e-4,1e-3",  # the command line narrows the grid
        ], stream="out")
    listed = re.findall(r"wanexp: sweep:\s+(\d+): (.+)", stdout)
    assert listed == [("0", "adapter.rank=4 optim.lr=0.0001"), ("1", "adapter.rank=4 optim.lr=0.001"),
                      ("2", "adapter.rank=8 optim.lr=0.0001"), ("3", "adapter.rank=8 optim.lr=0.001")], stdout[:2000]
    assert stdout.index("wanexp: sweep:   3:") < stdout.index("wanexp: finished")  # listed before any point
    sweep_dir = tmp_path / "outputs" / "sweeps" / "rank_lr"
    runs = sorted(p for p in sweep_dir.iterdir() if (p / "status.json").exists())
    assert len(runs) == 4, list(sweep_dir.iterdir())
    seen, groups = set(), set()
    for run in runs:
        cfg = OmegaConf.load(run / "config.yaml")
        seen.add((cfg.adapter.rank, cfg.optim.lr))
        assert cfg.adapter.alpha == cfg.adapter.rank  # the sweep ties alpha to rank
        assert cfg.run_name.startswith("rank_lr/") and (run / "lora" / "final" / "tiny_lora_comfyui.safetensors").is_file()
        (wb,) = (run / "wandb").glob("offline-run-*")
        groups.add(summary(wb)["group"])
    assert seen == {(4, 1e-4), (4, 1e-3), (8, 1e-4), (8, 1e-3)} and groups == {"rank_lr"}
    rows = list(csv.DictReader((sweep_dir / "summary.csv").open()))
    assert [(r["adapter.rank"], r["optim.lr"], r["state"]) for r in rows] == [
        ("4", "0.0001", "finished"), ("4", "0.001", "finished"), ("8", "0.0001", "finished"), ("8", "0.001", "finished")]
    assert all(float(r["final_train_loss"]) > 0 and float(r["samples_per_s"]) > 0 and r["val_loss"] == "" for r in rows)
    md = (sweep_dir / "summary.md").read_text()
    assert md.startswith("# Sweep rank_lr: 4 points (4 finished)")
    assert len([ln for ln in md.splitlines() if ln.startswith("|") and "finished" in ln]) == 4
    for png in ("loss.png", "heatmap.png"):
        assert (sweep_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resumed_run_continues_its_bar_history_and_wandb_run(shared_dir, tmp_path, monkeypatch, capsys):
    """After a resume the bar starts at the resumed step of the run's total, status.jsonl keeps the steps before it,
    and W&B continues the same run (offline: the same run id). Both runs through the CLI's entry in this process,
    W&B offline through its environment as in the other tests."""
    out = tmp_path / "resumed"
    common = [*_common(shared_dir, tmp_path), f"paths.data_dir={shared_dir}/data", "logger=wandb",
              "optim.scheduler=constant", "callbacks.checkpoint.every_n_train_steps=2", f"paths.output_dir={out}"]
    with _wandb_offline(monkeypatch, tmp_path):
        _main_ends(monkeypatch, capsys, [*common, "trainer.max_steps=2"])
        text = _main_ends(monkeypatch, capsys, [*common, "trainer.max_steps=4", "resume=last"])
    bars = _bars(text)
    assert bars[0] == ("2", "4") and bars[-1] == ("4", "4") and {t for _, t in bars} == {"4"}, bars
    history = [json.loads(x)["step"] for x in (out / "status.jsonl").read_text().splitlines()]
    assert history == [1, 2, 3, 4]
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({p.name.rpartition("-")[2] for p in runs}) == 1


def test_corrupt_clip_in_a_worker_fails_with_one_line(shared_dir, tmp_path, monkeypatch, capsys):
    """Through the CLI's entry in this process (the loader worker is still its own process)."""
    clips = tmp_path / "clips"
    clips.mkdir()
    (clips / "broken.mp4").write_bytes(bytes(range(256)) * 64)
    (clips / "meta.csv").write_text("video,prompt\nbroken.mp4,a broken clip\nbroken.mp4,the same broken clip\n")
    common = [*_common(shared_dir, tmp_path), f"data.metadata={clips}/meta.csv", "data.generate=null",
              "data.num_workers=1", "trainer.max_steps=2", "callbacks.progress=null"]
    # unprobed (data.probe=false), the clip fails in a loader worker: one line, status failed
    out = tmp_path / "run"
    code, err = _main(monkeypatch, capsys, [*common, "data.probe=false", f"paths.output_dir={out}"])
    assert code == 2, err[-30:]
    errors = [line for line in err if line.startswith("wanexp: error:")]
    assert len(errors) == 1 and "broken.mp4: cannot decode video" in errors[0], err[-30:]
    assert json.loads((out / "status.json").read_text())["state"] == "failed"
    # probed (the default), both rows are rejected before any weights load
    code, err = _main(monkeypatch, capsys, [*common, f"paths.output_dir={tmp_path}/probed"])
    errors = [line for line in err if line.startswith("wanexp: error:")]
    assert code == 2 and len(errors) == 1, err[-30:]
    assert "2 of 2 samples rejected" in errors[0] and "broken.mp4: cannot open video" in errors[0], errors[0]


def _entry(monkeypatch, capsys, args: list[str]):
    """wanexp.train.main set up to run ``python train.py ARGS`` in this process (sys.argv patched, output so far
    read away, HYDRA_FULL_ERROR restored unset after the test: main sets it for Hydra)."""
    import sys

    from wanexp.train import main

    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    monkeypatch.delenv("HYDRA_FULL_ERROR")
    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    capsys.readouterr()
    return main


def _main(monkeypatch, capsys, args: list[str]) -> tuple[int, list[str]]:
    """``python train.py ARGS`` in this process, a run that exits: exit code, stderr lines."""
    main = _entry(monkeypatch, capsys, args)
    with pytest.raises(SystemExit) as e:
        main()
    return e.value.code, capsys.readouterr().err.strip().splitlines()


def _main_ends(monkeypatch, capsys, args: list[str], stream: str = "both") -> str:
    """``python train.py ARGS`` in this process, a run that must end normally (an exit fails the test): what it
    wrote to stdout (``stream="out"``) or to both stdout and stderr."""
    _entry(monkeypatch, capsys, args)()
    out = capsys.readouterr()
    return out.out if stream == "out" else out.out + out.err


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() if p.is_file() else b"/" for p in sorted(root.rglob("*"))}


def _bad_cli_rows(tmp_path) -> list[tuple[list[str], str]]:
    """One row per place run() refuses (the values' own checks: tests/unit/test_config.py)."""
    from tests.unit.test_config import _resume_files

    lora, needle = _resume_files(tmp_path)["lora"]
    (tmp_path / "a_file").write_text("not a folder")
    return [
        (["trainer.devices=abc"], "trainer.devices=abc: must be auto, a device count"),  # config checks
        ([f"resume={lora}"], needle),  # the files a run needs
        (["paths.output_dir=" + str(tmp_path / "a_file")], f"paths.output_dir={tmp_path}/a_file: a file, not a folder"),
        (["resume=last"], "holds no checkpoint yet; start it fresh (resume=null)"),  # the run folder
    ]


def _broken_clips(tmp_path) -> Path:
    clips = tmp_path / "clips"
    clips.mkdir()
    (clips / "broken.mp4").write_bytes(bytes(range(256)) * 64)
    (clips / "meta.csv").write_text("video,prompt\nbroken.mp4,a broken clip\n")
    return clips / "meta.csv"


def test_bad_input_is_one_line_exit_2_and_writes_nothing(shared_dir, tmp_path, monkeypatch, capsys):
    """Each bad input through the CLI's entry (in process): exit code 2, one line on stderr, and nothing written:
    no run folder, no .hydra/ (also none in the working folder), no .lock."""
    monkeypatch.chdir(tmp_path)
    rows = _bad_cli_rows(tmp_path)
    before = _tree(tmp_path)
    common = ["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models", f"paths.data_dir={shared_dir}/data",
              f"paths.output_dir={tmp_path}/run", "callbacks.progress=null"]
    for args, needle in rows:
        code, err = _main(monkeypatch, capsys, [*common, *args])
        assert code == 2 and len(err) == 1 and err[0].startswith("wanexp: error: ") and needle in err[0], (args, err)
        assert _tree(tmp_path) == before, (args, set(_tree(tmp_path)) ^ set(before))
    # refused by the data checks, once the run folder is locked: the lock goes, the rejects report stays
    meta = _broken_clips(tmp_path)
    before = _tree(tmp_path)
    code, err = _main(monkeypatch, capsys, [*common, f"data.metadata={meta}", "data.generate=null"])
    assert code == 2 and len(err) == 1 and "1 of 1 samples rejected" in err[0], err
    assert set(_tree(tmp_path)) - set(before) == {"run", "run/rejects.jsonl"}
