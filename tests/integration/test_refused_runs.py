"""A refused run writes nothing: every check that can refuse a run, those that need the built model included, runs
before anything in the run folder is touched. Each refusal through the CLI's ``cli`` in this process, on a copy of a
finished run (resumed, and overwritten: ``experiment=demo`` sets overwrite=true) and on a fresh folder."""
from __future__ import annotations

import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import compose_cfg
from tests.integration.test_lifecycle import _tiny_overrides
from wanexp.train import cli

Usage = namedtuple("Usage", "total used free")


def _state(root: Path) -> dict[str, tuple[bytes | None, int]]:
    """Every file's bytes and every file's and folder's mtime (ns) under ``root``, the folder itself included."""
    paths = [root, *sorted(root.rglob("*"))]
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None, p.lstat().st_mtime_ns)
            for p in paths}


def _lora_with_a_block_the_model_lacks(src: Path, dst: Path) -> Path:
    """The run's own LoRA file with every module of block 0 copied to block 7 (the tiny model has 2 blocks)."""
    sd = load_file(src / "lora" / "final" / "tiny_lora_comfyui.safetensors")
    sd.update({k.replace(".blocks.0.", ".blocks.7."): v.clone() for k, v in sd.items() if ".blocks.0." in k})
    save_file(sd, dst)
    return dst


def _refusals(src: Path, tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (overrides, the one line's needle): the refusals of a run the config alone does not show."""
    lora = _lora_with_a_block_the_model_lacks(src, tmp_path / "other_model.safetensors")
    return {
        "blocks_to_swap": (["model.blocks_to_swap=100"],
                           "model.blocks_to_swap=100: the dense transformer has 2 blocks; set model.blocks_to_swap "
                           "to at most 2"),
        "init_from": ([f"adapter.init_from={lora}"],
                      "blocks.7.attn1.to_q.lora_A.weight [4, 32] is not in the model (2 blocks)"),
        "keep_last": (["callbacks.lora_export.keep_last=0"], "callbacks.lora_export.keep_last=0: must be >= 1"),
        # the start-up disk check with the disk reported full: a run continued for longer, or started over
        "disk": (["trainer.max_steps=400", "allow_resume_changes=true"], "needs ~"),
    }


def _refused(cfg, capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli(cfg)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("wanexp: error: "), err
    return err[0]


@pytest.mark.parametrize("mode", [["resume=last"], ["overwrite=true"]], ids=["resume", "overwrite"])
def test_every_refusal_leaves_a_finished_run_byte_and_mtime_identical(trained, tmp_path, capsys, monkeypatch, mode):
    """A finished run (status finished at step 4, checkpoints, LoRA exports incl. final, logs, its reject list)
    stays as it was, file by file and folder by folder, for each refusal, resumed or overwritten."""
    src = Path(trained("tiny")["output_dir"])
    out = tmp_path / "run"
    shutil.copytree(src, out, symlinks=True)
    assert json.loads((out / "status.json").read_text())["state"] == "finished"
    refusals = _refusals(src, tmp_path)
    before = _state(out)
    for name, (overrides, needle) in refusals.items():
        with monkeypatch.context() as m:
            if name == "disk":
                m.setattr(shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 1000, 1000))
            line = _refused(compose_cfg([*_tiny_overrides(trained("tiny")["cfg"], out), *mode, *overrides]), capsys)
        assert needle in line, (name, line)
        after = _state(out)
        assert after == before, (name, sorted(k for k in set(after) | set(before) if after.get(k) != before.get(k)))
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4


def test_every_refusal_of_a_fresh_run_leaves_no_folder(trained, tmp_path, capsys, monkeypatch):
    """The same refusals of a fresh run: no run folder (no config.yaml, status.json, logs/, .lock, rejects.jsonl)."""
    src = Path(trained("tiny")["output_dir"])
    out = tmp_path / "fresh" / "run"
    for name, (overrides, needle) in _refusals(src, tmp_path).items():
        with monkeypatch.context() as m:
            if name == "disk":
                m.setattr(shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 1000, 1000))
            line = _refused(compose_cfg([*_tiny_overrides(trained("tiny")["cfg"], out), *overrides]), capsys)
        assert needle in line, (name, line)
        assert not (tmp_path / "fresh").exists(), (name, [str(p) for p in (tmp_path / "fresh").rglob("*")])


def test_a_missing_prompts_file_under_the_demo_is_named_and_nothing_is_generated_beside_it(shared_dir, tmp_path,
                                                                                          capsys):
    """experiment=demo generates its clips (data.generate): a data.metadata that names another file which does not
    exist is that file's one line, not the demo's metadata.csv, and no clips are generated into its folder."""
    prompts = tmp_path / "mine" / "prompts.txt"
    line = _refused(compose_cfg(["experiment=demo", f"paths.tiny_model_dir={shared_dir}/models",
                                 f"paths.output_dir={tmp_path / 'run'}", f"data.metadata={prompts}",
                                 "objective=dmd", "model.first_frame_cond=0"]), capsys)
    assert line.startswith(f"wanexp: error: data.metadata={prompts}: file not found (data.generate lists the clips "
                           "it generates in a metadata.csv"), line
    assert "set data.generate=null" in line and not (tmp_path / "mine").exists() and not (tmp_path / "run").exists()
